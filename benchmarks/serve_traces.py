"""The serving benchmark's request traces (essay prompts of drawn lengths) and the KV budget sized from them."""

from __future__ import annotations

import math

import numpy as np

from .serve_config import ServeConfig, Trace


def trace_lengths(cfg: ServeConfig) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of the trace: seeded uniform draws in the configured ranges."""
    g = np.random.default_rng(cfg.seed)
    p = g.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1, size=cfg.num_requests)
    o = g.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1, size=cfg.num_requests)
    return [int(x) for x in p], [int(x) for x in o]


def footprint_blocks(prompt: int, output: int, block_size: int) -> int:
    """KV blocks a request holds at its end without eviction."""
    return -(-(prompt + output) // block_size)


def default_kv_blocks(trace: Trace, block_size: int, vanilla_target: float) -> int:
    """A KV budget holding ``vanilla_target + 0.5`` mean whole requests of the trace (no eviction): vanilla
    fits ``vanilla_target`` of them, and the budget sits half a request away from the next integer, so that
    neither vanilla's count nor an evicting engine's lands on a rounding edge (with exactly
    ``vanilla_target`` requests, a policy needing 1% over half the blocks would fit one request fewer)."""
    mean = sum(footprint_blocks(len(p), m, block_size) for p, m in trace) / len(trace)
    return int(math.ceil((vanilla_target + 0.5) * mean))


def fitting_prefix(trace: Trace, block_size: int, kv_blocks: int, want: int) -> int:
    """The largest ``n <= want`` such that the first ``n`` requests fit the budget together, whole."""
    n, used = 0, 0
    for p, m in trace[:want]:
        used += footprint_blocks(len(p), m, block_size)
        if used > kv_blocks:
            break
        n += 1
    return max(1, n)


def make_trace(model_dir: str, cfg: ServeConfig) -> Trace:
    """``[(prompt ids, max_tokens)]``: consecutive essay windows of the drawn lengths."""
    from transformers import AutoTokenizer

    from vtoken_bench.essays import essay_token_requests

    tok = AutoTokenizer.from_pretrained(model_dir)
    plens, olens = trace_lengths(cfg)
    prompts = essay_token_requests(tok, plens, 1, offset=cfg.seed * 7919)
    return list(zip(prompts, olens, strict=True))


def goodput_traces(cfg: ServeConfig, trace: Trace) -> tuple[Trace, Trace]:
    """``(goodput trace, unloaded trace)``: ``goodput_requests`` requests cycling over the trace, and its first
    ``unloaded_requests`` (vanilla's unloaded TTFT / TPOT set the SLOs)."""
    n = len(trace)
    return [trace[i % n] for i in range(cfg.goodput_requests)], trace[: cfg.unloaded_requests]


def lockstep_trace(cfg: ServeConfig, trace: Trace) -> Trace:
    """The requests the closed loop's lockstep rounds run: the trace's first ``throughput_requests`` (None: all).
    When that is the whole trace, those rounds also give vanilla's and H2O 0.5's rows."""
    return trace[: cfg.throughput_requests] if cfg.throughput_requests else trace
