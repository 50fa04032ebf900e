"""kvpress RULER peer: NVIDIA kvpress 0.5.5's own pipeline on RULER samples, answers to JSONL.

Runs in the kvpress venv (``.venv-kvpress``, made by ``make kvpress`` / ``scripts/setup_kvpress.sh``;
kvpress 0.5.x needs transformers<5.3, the main venv has 5.19).  Stand-alone: it imports neither vtoken
nor anything outside that venv.  ``vtoken-cli eval ruler`` (``vtoken_bench.ruler_eval``) runs it.

    .venv-kvpress/bin/python benchmarks/kvpress_ruler_peer.py --model-dir DIR --samples S.json \\
        --out OUT.jsonl --methods none,knorm,snapkv,... --ratios 0.25,0.5,0.75,0.875 [--threads 1] \\
        [--dump-ids IDS.json]
    .venv-kvpress/bin/python benchmarks/kvpress_ruler_peer.py --list

``S.json``: a JSON list of ``{"key", "context", "question", "answer_prefix", "max_new_tokens",
"context_ids", "question_ids"}``.  Each sample goes through kvpress's own pipeline
(``transformers.pipeline("kv-press-text-generation", ...)``): ``pipe.preprocess(context,
questions=[question], answer_prefix=answer_prefix, max_context_length=...)`` (0.5.5's ``preprocess``
takes no ``max_new_tokens``; ``max_context_length`` is the pipeline's default,
``min(tokenizer.model_max_length, 1e10)``), then ``pipe._forward(inputs, max_new_tokens=...,
press=press, cache=DynamicCache())``: the context is prefilled under the press, the question (+ the
chat template's assistant header + the answer prefix) runs through the compressed cache at its true
positions, greedy decoding follows and stops after EOS.

Before any method runs, the ids from ``preprocess`` are compared with the sample's ``context_ids`` /
``question_ids``; on a mismatch one line goes to stderr (key, part, lengths, first differing position)
and the exit code is 3.  ``--dump-ids IDS.json`` writes ``{key: {"context_ids", "question_ids"}}`` as
``preprocess`` gives them, without comparing, and exits 0 without running any method.

Output: one JSON line per (sample, method, ratio), appended and flushed at once:
``{"key", "sha", "method", "ratio", "answer", "seconds"}`` (``sha``: the sample's ``sha`` as given, the
fingerprint of its token ids; ``seconds``: wall time of ``_forward``).  Method ``none`` (the full cache)
runs once, ratio 0.0.  Configurations already in ``OUT.jsonl`` for the same key and ``sha`` are skipped
(resumable).  A configuration that raises is reported on stderr, the others still run, and the exit
code is then 4.  ``--list`` prints ``{"methods": [...], "unavailable": {name: why}}``.

Methods (:data:`METHODS`) are built as kvpress's ``evaluation/evaluate_registry.py`` builds the
corresponding press (default parameters; AdaKV's ExpectedAttention with ``epsilon=1e-2`` and the
Critical* ones with ``use_vnorm=False`` as there; RandomPress seeded, for resumable runs).  The model
is loaded in float32 with ``sdpa`` attention (AdaKV, CriticalKV and KVzip assert it is not ``eager``);
a second copy with ``eager`` is loaded on first use for the presses that need the attention weights
(:data:`EAGER`: ObservedAttentionPress).  Presses of the leaderboard that cannot run here are listed in
:data:`UNAVAILABLE`.

Workaround (``--no-mask-fix`` turns it off, for checking): presses that keep a different number of
tokens per layer (PyramidKVPress) leave cache layers of different lengths, while transformers 5.2
builds one attention mask per forward sized from layer 0's cache (``create_causal_mask`` ->
``get_mask_sizes(cache_position, 0)``).  The question forward then fails in every other layer ("The size
of tensor a (1778) must match the size of tensor b (1805)").  Every cached entry precedes the question,
so for a layer with K keys the right mask is layer 0's mask cut to its last K columns (wider) or
left-padded with visible entries (narrower: ``True`` for bool masks, ``0.0`` for additive float masks).
:func:`install_mask_fix` wraps every entry of ``ALL_ATTENTION_FUNCTIONS`` (``sdpa``, ..., after
kvpress's own head-masking patch) and the model module's ``eager_attention_forward`` (``eager`` is not
in that registry: llama's attention falls back to that module-level function) to do exactly this, and
nothing when the widths match (the mask object is passed through untouched).  The number of masks it
adjusted is printed per (sample, method).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# name -> kvpress press expression (the ratio goes to the scoring press); the builders are in make_press
METHODS: dict[str, str] = {
    "none": "no press (full cache), ratio 0.0",
    "knorm": "KnormPress()",
    "streaming_llm": "StreamingLLMPress()",
    "snapkv": "SnapKVPress()",
    "tova": "TOVAPress()",
    "observed_attention": "ObservedAttentionPress() (eager)",
    "keydiff": "KeyDiffPress()",
    "expected_attention": "ExpectedAttentionPress()",
    "chunkkv": "ChunkKVPress(press=SnapKVPress(), chunk_length=20)",
    "cur": "CURPress()",
    "lagkv": "LagKVPress()",
    "ada_expected_attention": "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))",
    "ada_snapkv": "AdaKVPress(SnapKVPress())",
    "pyramidkv": "PyramidKVPress()",
    "critical_ada_expected_attention": "CriticalAdaKVPress(ExpectedAttentionPress(use_vnorm=False))",
    "critical_expected_attention": "CriticalKVPress(ExpectedAttentionPress(use_vnorm=False))",
    "critical_snapkv": "CriticalKVPress(SnapKVPress())",
    "critical_ada_snapkv": "CriticalAdaKVPress(SnapKVPress())",
    "random": "RandomPress(seed=0)",
    "kvzip": "KVzipPress()",
    "kvzip_plus": "KVzipPress(kvzip_plus_normalization=True)",
    "compactor": "CompactorPress()",
    "ada_compactor": "AdaKVPress(CompactorPress())",
    "block_keydiff": "BlockPress(press=KeyDiffPress(), block_size=128)",
}
EAGER = frozenset({"observed_attention"})  # need the attention weights: the eager copy of the model
UNAVAILABLE: dict[str, str] = {
    "qfilter": "QFilterPress loads pretrained Q-filters from the hub (nthngdy/<model>_qfilt); none exist "
               "for SmolLM2 and the hub is offline",
    "duo_attention": "DuoAttentionPress downloads attention patterns from GitHub (mit-han-lab/duo-attention) "
                     "for a fixed list of checkpoints, SmolLM2 not among them; offline",
    "duo_attention_on_the_fly": "DuoAttentionPress(on_the_fly_scoring=True) needs the kmfoda/booksum dataset "
                                "from the hub; offline",
    "kvzap_linear": "DMSPress(KVzapPress('linear')) loads a trained KVzap model from the hub (per model, "
                    "none for SmolLM2), and is threshold-based (no compression ratio)",
    "kvzap_mlp": "DMSPress(KVzapPress('mlp')): trained KVzap model from the hub, threshold-based",
    "finch": "FinchPress is query-aware only (leaderboard: --query_aware): it needs the question inside the "
             "compressed context after a delimiter token added to the tokenizer; this protocol compresses "
             "the context alone",
    "fastkvzip": "FastKVzipPress downloads trained gates from the hub (Jang-Hyun/Fast-KVzip)",
    "restorekv": "RestoreKVPress downloads restore embeddings and a LoRA adapter from the hub "
                 "(higokri/RestoreKV-<model>)",
    "lukv": "LUKVPress downloads a pre-computed per-model budget curve over HTTP, only for a few "
            "checkpoints (Llama-3.1-8B, Qwen3-8B); offline",
}


def make_press(name: str, ratio: float):
    """kvpress's press for method ``name`` at compression ratio ``ratio`` (None for ``none``)."""
    import kvpress as kp

    r = ratio
    simple = {"knorm": kp.KnormPress, "streaming_llm": kp.StreamingLLMPress, "snapkv": kp.SnapKVPress,
              "tova": kp.TOVAPress, "observed_attention": kp.ObservedAttentionPress,
              "keydiff": kp.KeyDiffPress, "expected_attention": kp.ExpectedAttentionPress, "cur": kp.CURPress,
              "lagkv": kp.LagKVPress, "pyramidkv": kp.PyramidKVPress, "kvzip": kp.KVzipPress,
              "compactor": kp.CompactorPress}
    if name == "none":
        return None
    if name in simple:
        return simple[name](compression_ratio=r)
    builders = {
        "chunkkv": lambda: kp.ChunkKVPress(press=kp.SnapKVPress(compression_ratio=r), chunk_length=20),
        "ada_expected_attention": lambda: kp.AdaKVPress(
            kp.ExpectedAttentionPress(compression_ratio=r, epsilon=1e-2)),
        "ada_snapkv": lambda: kp.AdaKVPress(kp.SnapKVPress(compression_ratio=r)),
        "critical_ada_expected_attention": lambda: kp.CriticalAdaKVPress(
            kp.ExpectedAttentionPress(compression_ratio=r, use_vnorm=False)),
        "critical_expected_attention": lambda: kp.CriticalKVPress(
            kp.ExpectedAttentionPress(compression_ratio=r, use_vnorm=False)),
        "critical_snapkv": lambda: kp.CriticalKVPress(kp.SnapKVPress(compression_ratio=r)),
        "critical_ada_snapkv": lambda: kp.CriticalAdaKVPress(kp.SnapKVPress(compression_ratio=r)),
        "random": lambda: kp.RandomPress(compression_ratio=r, seed=0),
        "kvzip_plus": lambda: kp.KVzipPress(compression_ratio=r, kvzip_plus_normalization=True),
        "ada_compactor": lambda: kp.AdaKVPress(kp.CompactorPress(compression_ratio=r)),
        "block_keydiff": lambda: kp.BlockPress(press=kp.KeyDiffPress(compression_ratio=r), block_size=128),
    }
    if name not in builders:
        raise KeyError(f"unknown method {name!r}")
    return builders[name]()


# --------------------------------------------------------------------------- mask workaround

MASK_FIXES = [0]  # masks adjusted so far


def fit_mask(attention_mask, key):
    """``attention_mask`` with its last dimension fitted to the key length (see the module docstring)."""
    import torch

    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() < 2:
        return attention_mask
    k_len, width = key.shape[-2], attention_mask.shape[-1]
    if width == k_len:
        return attention_mask
    MASK_FIXES[0] += 1
    if width > k_len:
        return attention_mask[..., width - k_len:]
    visible = True if attention_mask.dtype == torch.bool else 0.0
    pad = torch.full((*attention_mask.shape[:-1], k_len - width), visible, dtype=attention_mask.dtype,
                     device=attention_mask.device)
    return torch.cat([pad, attention_mask], dim=-1)


def _fitted(func):
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        return func(module, query, key, value, fit_mask(attention_mask, key), *args, **kwargs)

    wrapper.__wrapped__ = func
    wrapper._vtoken_mask_fix = True
    return wrapper


def install_mask_fix(model_module_names=("transformers.models.llama.modeling_llama",)) -> list[str]:
    """Wrap ``ALL_ATTENTION_FUNCTIONS``' entries and the modules' ``eager_attention_forward`` (idempotent);
    call after ``import kvpress``.  Returns what was wrapped."""
    import importlib

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    done = []
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        func = ALL_ATTENTION_FUNCTIONS[name]
        if not getattr(func, "_vtoken_mask_fix", False):
            ALL_ATTENTION_FUNCTIONS[name] = _fitted(func)
            done.append(name)
    for mod_name in model_module_names:
        mod = importlib.import_module(mod_name)
        func = getattr(mod, "eager_attention_forward", None)
        if func is not None and not getattr(func, "_vtoken_mask_fix", False):
            mod.eager_attention_forward = _fitted(func)
            done.append(f"{mod_name}.eager_attention_forward")
    return done


# --------------------------------------------------------------------------- pipeline


class Peer:
    """The sdpa pipeline, and the eager one on first use."""

    def __init__(self, model_dir: Path):
        import kvpress  # noqa: F401  (registers the pipeline, patches the attention functions)
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the log

        self._torch, self._auto, self._pipeline = torch, AutoModelForCausalLM, pipeline
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.pipes = {"sdpa": self._load("sdpa")}

    def _load(self, attn: str):
        model = self._auto.from_pretrained(str(self.model_dir), dtype=self._torch.float32,
                                           attn_implementation=attn).eval()
        return self._pipeline("kv-press-text-generation", model=model, tokenizer=self.tokenizer, device="cpu")

    def pipe(self, method: str):
        attn = "eager" if method in EAGER else "sdpa"
        if attn not in self.pipes:
            self.pipes[attn] = self._load(attn)
        return self.pipes[attn]

    def preprocess(self, sample: dict) -> dict:
        pipe = self.pipes["sdpa"]
        max_context_length = min(self.tokenizer.model_max_length, int(1e10))  # _sanitize_parameters' default
        return pipe.preprocess(sample["context"], questions=[sample["question"]],
                               answer_prefix=sample["answer_prefix"] or "",
                               max_context_length=max_context_length)

    def run(self, method: str, ratio: float, inputs: dict, max_new_tokens: int) -> str:
        from transformers import DynamicCache

        press = make_press(method, ratio)
        with self._torch.inference_mode():
            answers = self.pipe(method)._forward(inputs, max_new_tokens=max_new_tokens, press=press,
                                                 cache=DynamicCache())
        return answers[0]


def ids_of(inputs: dict) -> tuple[list[int], list[int]]:
    return inputs["context_ids"][0].tolist(), inputs["questions_ids"][0][0].tolist()


def first_mismatch(key: str, ours: tuple[list[int], list[int]], sample: dict) -> str | None:
    for part, got in zip(("context_ids", "question_ids"), ours, strict=True):
        want = [int(x) for x in sample[part]]
        if got != want:
            pos = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                       min(len(got), len(want)))
            return (f"ids mismatch: key={key} part={part} kvpress_len={len(got)} sample_len={len(want)} "
                    f"first_diff_at={pos}")
    return None


def done_configs(out: Path) -> set[tuple[str, str | None, str, float]]:
    """``(key, sha, method, ratio)`` of every answer already in ``out`` (``sha``: the sample's token ids'
    fingerprint, so an answer for other ids under the same key is not taken as done)."""
    done: set[tuple[str, str | None, str, float]] = set()
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                d = json.loads(line)
                done.add((d["key"], d.get("sha"), d["method"], round(float(d["ratio"]), 6)))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from an interrupted run
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--samples", type=Path, help="JSON list of samples (see the module docstring)")
    ap.add_argument("--out", type=Path, help="answers, JSON lines (appended; done configurations skipped)")
    ap.add_argument("--methods", default="none", help=f"comma-separated, of: {', '.join(METHODS)}")
    ap.add_argument("--ratios", default="0.25,0.5,0.75,0.875", help="comma-separated compression ratios")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--dump-ids", type=Path, default=None,
                    help="write kvpress's preprocess ids of every sample here and exit (no comparison/run)")
    ap.add_argument("--list", action="store_true", help="print the methods and unavailable presses (JSON)")
    ap.add_argument("--no-mask-fix", action="store_true", help="leave the mask workaround out (checks only)")
    args = ap.parse_args(argv)

    if args.list:
        print(json.dumps({"methods": list(METHODS), "unavailable": UNAVAILABLE}))
        return 0
    need = ["model_dir", "samples"] + ([] if args.dump_ids else ["out"])
    missing = [f"--{n.replace('_', '-')}" for n in need if getattr(args, n) is None]
    if missing:
        ap.error(f"required: {', '.join(missing)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        why = "; ".join(f"{m}: {UNAVAILABLE[m]}" if m in UNAVAILABLE else f"{m}: unknown" for m in bad)
        ap.error(f"methods not available: {why}")
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]

    import torch

    torch.set_num_threads(max(1, args.threads))
    samples = json.loads(args.samples.read_text())
    peer = Peer(args.model_dir)
    if not args.no_mask_fix:
        install_mask_fix()
    inputs = {s["key"]: peer.preprocess(s) for s in samples}

    if args.dump_ids is not None:
        dump = {}
        for key, inp in inputs.items():
            c, q = ids_of(inp)
            dump[key] = {"context_ids": c, "question_ids": q}
        args.dump_ids.parent.mkdir(parents=True, exist_ok=True)
        args.dump_ids.write_text(json.dumps(dump))
        print(f"wrote kvpress preprocess ids of {len(dump)} samples to {args.dump_ids}")
        return 0

    for s in samples:
        msg = first_mismatch(s["key"], ids_of(inputs[s["key"]]), s)
        if msg is not None:
            print(msg, file=sys.stderr)
            return 3

    done = done_configs(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists() and args.out.stat().st_size and not args.out.read_bytes().endswith(b"\n"):
        with args.out.open("a") as f:
            f.write("\n")  # close a torn last line
    failures = 0
    with args.out.open("a") as out:
        for si, s in enumerate(samples):
            key, inp = s["key"], inputs[s["key"]]
            n_ctx, n_q = inp["context_ids"].shape[1], inp["questions_ids"][0].shape[1]
            for method in methods:
                todo = [r for r in ([0.0] if method == "none" else ratios)
                        if (key, s.get("sha"), method, round(r, 6)) not in done]
                if not todo:
                    print(f"[{si + 1}/{len(samples)}] {key} {method}: done already", flush=True)
                    continue
                fixes0, parts = MASK_FIXES[0], []
                for r in todo:
                    t0 = time.perf_counter()
                    try:
                        answer = peer.run(method, r, inp, int(s["max_new_tokens"]))
                    except Exception:  # noqa: BLE001 - reported, the other configurations still run
                        failures += 1
                        print(f"FAILED key={key} method={method} ratio={r}:\n{traceback.format_exc()}",
                              file=sys.stderr, flush=True)
                        parts.append(f"r={r}: FAILED")
                        continue
                    dt = time.perf_counter() - t0
                    out.write(json.dumps({"key": key, "sha": s.get("sha"), "method": method, "ratio": r,
                                          "answer": answer,
                                          "seconds": round(dt, 3)}) + "\n")
                    out.flush()
                    parts.append(f"r={r}: {dt:.1f}s {answer.strip()[:60]!r}")
                print(f"[{si + 1}/{len(samples)}] {key} ctx={n_ctx} q={n_q} {method} "
                      f"(mask fixes {MASK_FIXES[0] - fixes0}): " + " | ".join(parts), flush=True)
    if failures:
        print(f"{failures} configuration(s) failed", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
