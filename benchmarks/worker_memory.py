"""How a vLLM CPU engine's resident memory moves with the shapes it serves (the soak's RSS question).

An in-process engine (vanilla vLLM unless ``--policy``; SmolLM2, float32, eager) serves rounds of 8 greedy
requests; after each round glibc's ``malloc_trim(0)`` runs (as the plugin's worker does) and the round's RSS
and glibc's in-use heap (``mallinfo2().uordblks``) are printed. ``--mode``:

* ``same``: the same 8 prompts every round (same lengths, same tokens);
* ``content``: the same lengths, new tokens every round;
* ``lens``: new lengths (256-768) every round, 64 generated tokens;
* ``new``: new lengths and new output lengths (16-64).

oneDNN reads ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` once, so compare capacities in separate processes::

    OMP_NUM_THREADS=1 .venv/bin/python -m vtoken_bench.worker_memory --mode lens --rounds 10
    OMP_NUM_THREADS=1 ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 .venv/bin/python -m vtoken_bench.worker_memory \\
        --mode lens --rounds 10 --vllm-lru 1      # both caches off: flat

``--vllm-lru N`` replaces the size of vLLM's per-weight-shape primitive LRU (32) for this process (an
experiment: vLLM's own argument to ``create_onednn_mm``, no vLLM source changed). docs/vllm.md, soak.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import numpy as np


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["same", "content", "lens", "new"], default="lens")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--vllm-lru", type=int, default=0, help="vLLM's primitive LRU per weight shape (0: its own 32)")
    ap.add_argument("--policy", default="", help="run the vtoken plugin with this policy at ratio 0.5")
    args = ap.parse_args(argv)

    from vtoken_bench.serve_config import set_env

    set_env()  # the in-process engine settings every serving benchmark uses
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken_bench.models import smollm2_path
    from vtoken_bench.serve_engine import kv_bytes
    from vtoken_runtime.vllm_plugin import vllm_engine_args

    if args.vllm_lru:
        import vllm._custom_ops as ops

        original = ops.create_onednn_mm
        ops.create_onednn_mm = lambda weight, size=128: original(weight, args.vllm_lru)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    model = str(smollm2_path())
    kw = dict(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, block_size=32,
              kv_cache_memory_bytes=kv_bytes(model, 256, 32, "float32"), enforce_eager=True, max_num_seqs=8,
              seed=0, enable_prefix_caching=False)
    if args.policy:
        kw.update(vllm_engine_args(policy=args.policy, eviction_ratio=0.5))
    llm = LLM(**kw)
    g = np.random.default_rng(0)
    base = g.integers(256, 769, size=8).tolist()
    rss: list[float] = []
    for r in range(args.rounds):
        lens = base if args.mode in ("same", "content") else g.integers(256, 769, size=8).tolist()
        tok = np.random.default_rng(0 if args.mode == "same" else r + 1)
        batch = [TokensPrompt(prompt_token_ids=tok.integers(3, 48998, size=n).tolist()) for n in lens]
        out = [64] * 8 if args.mode != "new" else g.integers(16, 65, size=8).tolist()
        t = time.perf_counter()
        llm.generate(batch, [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True) for m in out],
                     use_tqdm=False)
        libc.malloc_trim(0)
        rss.append(round(_rss_mb(), 1))
        heap = libc.mallinfo2().uordblks / 2**20
        print(f"round {r}: RSS {rss[-1]:.1f} MB, heap in use {heap:.1f} MB, {time.perf_counter() - t:.1f} s", flush=True)
    print(json.dumps({"mode": args.mode, "onednn_capacity": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
                      "vllm_lru": args.vllm_lru or 32, "rss_mb": rss,
                      "growth_mb_per_round": round((rss[-1] - rss[0]) / max(1, len(rss) - 1), 2)}), flush=True)
    os._exit(0)  # skip teardown: an engine in this process would take seconds to stop


if __name__ == "__main__":
    main()
