"""Needle-in-a-haystack heatmap: the grid's validation, the prompts' determinism, the heatmap and the table
from a synthetic result, the CLI's option checks (a tiny Typer app around the command; nothing loads a
model) and, slow, a tiny real grid on SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from vtoken_bench import niah_heatmap as nh
from vtoken_cli.eval_niah_cmd import eval_niah

KEYS = {"method", "ratio", "context_tokens", "depth", "score"}


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(eval_niah)
    return app


def _synthetic(methods=("full", "snapkv", "knorm"), lengths=(1024, 2048, 4096), depths=(0.0, 0.5, 1.0)) -> dict:
    rows = []
    for mi, m in enumerate(methods):
        for li, n in enumerate(lengths):
            for di, d in enumerate(depths):
                score = 1.0 if m == "full" else [0.0, 0.5, 1.0, 0.25][(mi + li + di) % 4]
                rows.append({"method": m, "ratio": 0.0 if m == "full" else 0.5, "context_tokens": n, "depth": d,
                             "score": score, "samples": 4})
    return {"model": "SmolLM2 (synthetic)", "protocol": "test", "samples": 4, "rows": rows, "cases": [],
            "seconds": 1.0}


# --------------------------------------------------------------------------- grid and prompts

def test_grid_defaults_sorted_and_deduplicated() -> None:
    g = nh.make_grid()
    assert g.methods == ("full", "snapkv", "knorm") and g.ratio == 0.5
    assert g.depths == tuple(round(0.1 * i, 1) for i in range(11)) and g.lengths == (1024, 2048, 4096)
    q = nh.make_grid(quick=True)
    assert set(q.lengths) <= set(g.lengths) and set(q.depths) <= set(g.depths) and q.prompts < g.prompts
    h = nh.make_grid(lengths=(2048, 1024, 2048), depths=(1.0, 0.0, 0.5), policies=("full", "knorm", "knorm"),
                     samples=None)
    assert (h.lengths, h.depths, h.methods, h.samples) == ((1024, 2048), (0.0, 0.5, 1.0), ("full", "knorm"), 1)


@pytest.mark.parametrize(("kw", "match"), [
    ({"policies": ("nope",)}, "unknown policy nope"),
    ({"depths": (0.5, 1.5)}, r"depths: \[1.5\] outside \[0, 1\]"),
    ({"depths": (-0.1,)}, "depths"),
    ({"lengths": (64,)}, r"lengths: \[64\] outside"),
    ({"lengths": (16384,)}, "lengths"),
    ({"lengths": ()}, "lengths: none"),
    ({"samples": 0}, "samples"),
    ({"ratio": 1.0}, "ratio"),
    ({"ratio": -0.1}, "ratio"),
])
def test_grid_rejects_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        nh.make_grid(**kw)


def test_parse_list() -> None:
    assert nh.parse_list("1024, 2048", int, "--lengths") == (1024, 2048)
    assert nh.parse_list("0,.5,1", float, "--depths") == (0.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="--lengths: '1k' is not a comma-separated list of ints"):
        nh.parse_list("1k", int, "--lengths")
    with pytest.raises(ValueError, match="empty"):
        nh.parse_list(" , ", str, "--policies")


def test_prompts_are_seeded_per_cell() -> None:
    from vtoken_bench.models import ByteTokenizer

    tok = ByteTokenizer()
    a = nh.niah_prompt(tok, 600, 0.5, 0, seed=0)
    assert a.input_ids == nh.niah_prompt(tok, 600, 0.5, 0, seed=0).input_ids  # deterministic
    assert len(a.input_ids) == 600 and str(a.passkey) in tok.decode(a.context_ids[slice(*a.needle_span)])
    assert 10_000 <= a.passkey <= 99_999
    b = nh.niah_prompt(tok, 600, 0.5, 1, seed=0)  # another sample: another passkey and filler
    assert b.passkey != a.passkey and nh.filler_offset(tok, 0, 1) != nh.filler_offset(tok, 0, 0)
    assert nh.niah_prompt(tok, 600, 0.5, 0, seed=1).passkey != a.passkey
    # one sample's filler is the same text at every depth: the needle moves through it
    lo, hi = nh.niah_prompt(tok, 600, 0.0, 0), nh.niah_prompt(tok, 600, 1.0, 0)
    assert lo.needle_span[0] < a.needle_span[0] < hi.needle_span[0]
    strip = [t for i, t in enumerate(lo.context_ids) if not lo.needle_span[0] <= i < lo.needle_span[1]]
    strip_hi = [t for i, t in enumerate(hi.context_ids) if not hi.needle_span[0] <= i < hi.needle_span[1]]
    assert tok.decode(strip)[:300] == tok.decode(strip_hi)[:300]


# --------------------------------------------------------------------------- reporting

def test_heatmap_png(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    path = nh.plot_heatmap(_synthetic(), tmp_path / "sub" / "h.png")
    assert path.stat().st_size > 10_000
    img = mpimg.imread(path)
    assert img.shape[1] > 2 * img.shape[0]  # three panels side by side
    one = nh.plot_heatmap(_synthetic(methods=("full",), lengths=(512,), depths=(0.5,)), tmp_path / "one.png")
    assert one.stat().st_size > 1_000
    partial = _synthetic()
    partial["rows"] = partial["rows"][:-1]  # a missing cell is left blank
    assert nh.plot_heatmap(partial, tmp_path / "p.png").stat().st_size > 10_000


def test_table_has_a_column_per_method_and_length() -> None:
    res = _synthetic()
    t = nh.niah_table(res)
    assert len(t.columns) == 1 + 3 * 3 and t.row_count == 3 + 1  # depths + the mean row
    con = Console(record=True, width=250)
    con.print(t)
    text = con.export_text()
    assert "full cache" in text and "snapkv @ 0.5" in text and "knorm @ 0.5" in text and "4K" in text
    assert "100%" in text and "mean" in text and "0.25" in text


# --------------------------------------------------------------------------- CLI

def _no_run(*a, **k):  # the checks must fail before a model is loaded
    raise AssertionError("run_niah called")


@pytest.mark.parametrize(("args", "msg"), [
    (["--policies", "snapkv,nope"], "unknown policy nope"),
    (["--depths", "0,1.5"], "depths: [1.5] outside [0, 1]"),
    (["--lengths", "1024,32"], "lengths: [32] outside"),
    (["--lengths", "1k"], "--lengths: '1k' is not a comma-separated list of ints"),
    (["--samples", "0"], "samples"),
    (["--ratio", "1"], "ratio"),
])
def test_cli_rejects_bad_options_in_one_line(monkeypatch: pytest.MonkeyPatch, args: list[str], msg: str) -> None:
    monkeypatch.setattr(nh, "run_niah", _no_run)
    res = CliRunner().invoke(_app(), args)
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bad option value:") and msg in lines[0], res.stderr


def test_cli_typer_rejects_a_non_number() -> None:
    assert CliRunner().invoke(_app(), ["--samples", "two"]).exit_code == 2


def test_cli_runs_the_grid_it_is_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = {}

    def fake(grid, **kw):
        seen["grid"] = grid
        return _synthetic(methods=grid.methods, lengths=grid.lengths, depths=grid.depths)

    monkeypatch.setattr(nh, "run_niah", fake)
    out, png = tmp_path / "r.json", tmp_path / "h.png"
    res = CliRunner().invoke(_app(), ["--quick", "--depths", "0,1", "--policies", "knorm,tova", "--ratio", "0.7",
                                      "--seed", "3", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    g = seen["grid"]
    assert (g.lengths, g.depths, g.methods, g.ratio, g.seed) == (nh.QUICK["lengths"], (0.0, 1.0),
                                                                 ("full", "knorm", "tova"), 0.7, 3)
    assert "knorm @ 0.5" in res.stdout and "needle in a haystack" in res.stdout  # the table, on stdout
    assert f"plot: {png}" in res.stderr and "json:" in res.stderr and "plot:" not in res.stdout
    assert png.stat().st_size > 5_000
    assert all(KEYS <= set(r) for r in json.loads(out.read_text())["rows"])


# --------------------------------------------------------------------------- real model

@pytest.mark.slow
def test_tiny_real_grid(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "h.png"
    res = CliRunner().invoke(_app(), ["--lengths", "768", "--depths", "0.2,0.8", "--samples", "1", "--policies",
                                      "knorm", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["methods"] == ["full", "knorm"] and d["lengths"] == [768] and d["depths"] == [0.2, 0.8]
    assert len(d["rows"]) == 2 * 1 * 2
    for r in d["rows"]:
        assert KEYS <= set(r) and r["score"] in (0.0, 1.0) and r["context_tokens"] == 768
        assert r["ratio"] == (0.0 if r["method"] == "full" else 0.5)
    full = [r["score"] for r in d["rows"] if r["method"] == "full"]
    assert max(full) == 1.0, d["cases"]  # the full cache finds the needle at least at one depth
    for c in d["cases"]:  # the answers are what the scores say
        assert set(c["found"]) == {"full", "knorm"}
        assert all(c["found"][m] == (str(c["passkey"]) in c["answers"][m]) for m in c["found"])
        assert c["context_len"] < 768 and c["needle_span"][0] < c["needle_span"][1] <= c["context_len"]
    assert png.stat().st_size > 5_000
