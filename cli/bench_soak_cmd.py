"""``vtoken-cli bench soak``: one real server under a mixed open-loop load; checks printed as one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer


def _pair(text: str, what: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{what}: expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise typer.BadParameter(f"{what}: expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def bench_soak(
    minutes: Annotated[float, typer.Option(min=0.05, help="open-loop arrivals for this long")] = 10.0,
    max_requests: Annotated[int, typer.Option(min=1, help="at most this many requests")] = 400,
    rate: Annotated[float, typer.Option(min=0.001, help="Poisson arrival rate, requests per second")] = 0.15,
    prompt_tokens: Annotated[str, typer.Option(help="LO,HI: prompt lengths (essay tokens)")] = "1024,3072",
    output_tokens: Annotated[str, typer.Option(help="LO,HI: max_tokens of good requests")] = "16,64",
    replay: Annotated[int, typer.Option(min=0, help="completed greedy requests re-run alone at the end")] = 8,
    kv_blocks: Annotated[int, typer.Option(min=8, help="KV cache size in blocks")] = 256,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 8,
    warm_requests: Annotated[int | None, typer.Option(min=0, help="concurrent longest-prompt evicting requests in "
                                                                  "the warm-up, before the RSS baseline (default: "
                                                                  "--max-num-seqs)")] = None,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="no torch.compile (faster start)")] = False,
    seed: Annotated[int, typer.Option()] = 0,
    drain_timeout: Annotated[float, typer.Option(help="seconds to wait for in-flight requests")] = 600.0,
    server_log: Annotated[Path | None, typer.Option(help="the server's log file")] = None,
    as_json: Annotated[Path | None, typer.Option("--json", help="also write the JSON here")] = None,
) -> None:
    """Soak one `vtoken-cli serve` (h2o 0.5, float32): mixed requests (evicting, opted out, own budgets, pinned
    spans, invalid, disconnects, chat n>1, context limit); exit 1 if a check fails (named on stderr)."""
    from vtoken_bench.serve_soak import SoakAborted, SoakConfig, run_soak

    cfg = SoakConfig(minutes=minutes, max_requests=max_requests, rate=rate,
                     prompt_tokens=_pair(prompt_tokens, "--prompt-tokens"),
                     output_tokens=_pair(output_tokens, "--output-tokens"), replay=replay, kv_blocks=kv_blocks,
                     max_num_seqs=max_num_seqs, warm_requests=warm_requests, enforce_eager=enforce_eager, seed=seed,
                     drain_timeout_s=drain_timeout, log=server_log)
    try:
        out = run_soak(cfg)
    except SoakAborted as e:
        print(f"soak: FAIL server_alive: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if as_json:
        as_json.parent.mkdir(parents=True, exist_ok=True)
        as_json.write_text(text)
    bad = {k: v for k, v in out["checks"].items() if v != "PASS"}
    for k, v in bad.items():
        print(f"soak: {v} {k}", file=sys.stderr)
    raise typer.Exit(1 if bad else 0)
