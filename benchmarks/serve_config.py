"""The serving benchmark's settings (:class:`ServeConfig`), the process environment its engines need, and
the plugin settings of an evicting row (:func:`plugin_args`). See ``serve.py`` for what the benchmark measures."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
       "VLLM_USE_V2_MODEL_RUNNER": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_LOGGING_LEVEL": "WARNING"}


WHEN = ("prefill", "chunks")


DTYPES = {"float32": 4, "bfloat16": 2}  # dtype -> bytes per element


ONLY = ("all", "stats-cost", "goodput")  # ServeConfig.only: the whole report, (c)'s statistics cost or (b) alone


MODES = {"naive": "naive", "vtoken": "compact"}  # row label -> plugin mode


Trace = list[tuple[list[int], int]]  # [(prompt ids, max_tokens)]


@dataclass
class ServeConfig:
    policies: tuple[str, ...] = ("h2o", "scissorhands", "streaming_llm")
    ratios: tuple[float, ...] = (0.3, 0.5, 0.7)
    modes: tuple[str, ...] = ("naive", "vtoken")
    num_requests: int = 16  # > 3 x vanilla's running peak (5): the 0.7 rows' peak is not capped by the trace
    prompt_tokens: tuple[int, int] = (1024, 1536)  # inclusive range of prompt lengths
    output_tokens: tuple[int, int] = (128, 192)  # inclusive range of output lengths
    block_size: int = 32
    # the model's and KV cache's dtype: "auto" (resolve_dtype: bfloat16, the model's own dtype and what `vtoken-cli
    # serve` runs, on a CPU with AMX tiles, every engine on vLLM's amx attention, whose KV layout the statistics
    # kernel reads in place, ~2.3x the closed loop of float32; float32 elsewhere), "float32" or "bfloat16"
    dtype: str = "auto"
    chunk_tokens: int = 128  # a request's prefill chunk (long_prefill_token_threshold): peaks at budget + chunk
    # max_num_batched_tokens (None: chunk_tokens). Larger lets several requests prefill in one step, but then
    # vLLM admits more requests than the KV budget holds and preempts them later: vanilla's running peak
    # (6 with 512 on the quick trace, whose budget holds 3 whole requests) stops meaning capacity
    step_tokens: int | None = None
    kv_blocks: int | None = None  # None: (vanilla_target + 0.5) x the trace's mean whole-request footprint
    vanilla_target: float = 4.0
    # the vToken / Naive rows' budget slack: "block" (the blocks of 0, fewer evictions) or tokens (0: evict every
    # step that exceeds the budget)
    slack: int | str = "block"
    max_model_len: int | None = None  # None: longest prompt + longest output, rounded up to a block
    when: str = "chunks"
    clock: str = "cpu"  # TTFT / TPOT / arrivals of the goodput runs: "cpu" (see ServingClock) or "wall"
    # rows whose goodput is searched besides vanilla's: "all", "none", or "POLICY@RATIO[,...]" (vToken rows;
    # "naive:POLICY@RATIO" for a Naive-Evict row)
    goodput_rows: str = "h2o@0.5"
    # requests per goodput probe: at attainment 0.9, 20 allow 2 misses (quick: 10 allow 1), so one slow request
    # is not a verdict
    goodput_requests: int = 20
    # after the paired search, rounds of every goodput engine at every goodput found (steps recorded): the
    # attainment's spread at each goodput and where the decoding time goes
    confirm_rounds: int = 2
    # max_num_seqs of the goodput engines, vanilla's included (None: the trace size, no cap). On a compute-bound
    # machine a cap keeps the prompts an evicting engine admits from stretching every running request's TPOT
    goodput_max_seqs: int | None = None
    unloaded_requests: int = 3
    ttft_slo_factor: float = 5.0
    tpot_slo_factor: float = 3.0
    slo_attainment: float = 0.9
    rate_factor: float = 2.0
    max_ladder: int = 4
    bisect_steps: int = 2
    rounds: int = 4  # interleaved rounds of (c) (6 balances the orders of interleaved_order for 3 engines)
    throughput_rounds: int = 3  # lockstep rounds of vanilla vs vToken H2O 0.5 (closed loop)
    throughput_requests: int | None = 8  # the trace's first requests those rounds run (None: the whole trace)
    workers: int = 2  # processes running the report's parts side by side (1: one after another in this process)
    rebuild: bool = True  # build the engines of (c) afresh every round (see run_serve_benchmark)
    overhead_requests: int = 1
    seed: int = 0
    model: str | None = None
    # "stats-cost": only (c)'s H2O 0.5 vs policy none runs (the same engines, trace, rounds and report fields as
    # the full benchmark's ``stats_cost``), without (a), (b) and the overhead trio: minutes, not the whole run.
    # "goodput": only (b): vanilla's SLOs and goodput, then the goodput rows' (``goodput_rows``), e.g. to see
    # how the comparison moves with the SLO multiples or the prefill chunk
    only: str = "all"
    # (c)'s statistics cost: more policies run alone at 0.5 beside H2O and policy none, each reported against
    # policy none (``stats_cost.extra``), e.g. an unequal-budget policy (issue 39)
    stats_extra: tuple[str, ...] = ()

    def goodput_keys(self) -> set[tuple[str, str, float]] | None:
        """``goodput_rows`` as ``{(mode, policy, ratio)}`` (None: every row)."""
        g = self.goodput_rows.strip()
        if g == "all":
            return None
        if g in ("none", ""):
            return set()
        out = set()
        for item in g.split(","):
            mode, _, rest = item.strip().rpartition(":")
            pol, at, ratio = rest.partition("@")
            try:
                r = float(ratio)
            except ValueError:
                r = -1.0
            if not at or not pol or (mode or "vtoken") not in MODES or not 0.0 <= r < 1.0:
                raise ValueError(f"goodput_rows item {item!r}; expected POLICY@RATIO or naive:POLICY@RATIO "
                                 "(or all / none)")
            out.add((mode or "vtoken", pol, round(r, 6)))
        return out

    @classmethod
    def quick(cls) -> ServeConfig:
        return cls(policies=("h2o",), ratios=(0.5, 0.7), modes=("vtoken",), num_requests=11,
                   prompt_tokens=(1024, 1152), output_tokens=(64, 96), vanilla_target=3.0,
                   goodput_rows="h2o@0.5", goodput_requests=10, unloaded_requests=2, max_ladder=3, bisect_steps=1,
                   confirm_rounds=1,
                   rounds=3, rebuild=False, overhead_requests=1, throughput_rounds=3, throughput_requests=None)

    def validate(self) -> None:
        if self.only not in ONLY:
            raise ValueError(f"only={self.only!r}; expected one of {ONLY}")
        if self.when not in WHEN:
            raise ValueError(f"when={self.when!r}; expected one of {WHEN}")
        if bad := [m for m in self.modes if m not in MODES]:
            raise ValueError(f"modes {bad}; expected some of {sorted(MODES)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected auto or one of {tuple(DTYPES)}")
        if self.clock not in ("cpu", "wall"):
            raise ValueError(f"clock={self.clock!r}; expected cpu or wall")
        self.goodput_keys()  # raises on a malformed list
        if self.goodput_max_seqs is not None and self.goodput_max_seqs < 1:
            raise ValueError(f"goodput_max_seqs={self.goodput_max_seqs}; expected >= 1 (or None: no cap)")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}; expected >= 1")
        for name, (lo, hi) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}=({lo}, {hi}); expected 1 <= min <= max")
        if not 0.0 < self.slo_attainment <= 1.0:
            raise ValueError(f"slo_attainment={self.slo_attainment}; expected (0, 1]")
        if self.rate_factor <= 1.0:
            raise ValueError(f"rate_factor={self.rate_factor}; expected > 1")
        if any(not 0.0 <= r < 1.0 for r in self.ratios):
            raise ValueError(f"ratios {self.ratios}; expected values in [0, 1)")
        if self.chunk_tokens < 1 or (self.step_tokens is not None and self.step_tokens < self.chunk_tokens):
            raise ValueError(f"chunk_tokens={self.chunk_tokens}, step_tokens={self.step_tokens}; expected "
                             "1 <= chunk_tokens <= step_tokens")
        from vtoken_sdk.budget import parse_slack

        self.slack = parse_slack(self.slack)
        if self.confirm_rounds < 0:
            raise ValueError(f"confirm_rounds={self.confirm_rounds}; expected >= 0")
        if self.rounds < 1 or self.throughput_rounds < 1:
            raise ValueError(f"rounds={self.rounds}, throughput_rounds={self.throughput_rounds}; expected >= 1")


def set_env() -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)


def resolve_dtype(dtype: str) -> str:
    """``"auto"`` -> ``"bfloat16"`` on a CPU with AMX tiles (SmolLM2's own dtype, the one the server runs; vLLM's
    amx attention), else ``"float32"`` (bf16 without AMX runs vLLM's slower vec kernels); any other value as it is."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cpu._is_amx_tile_supported() else "float32"


def unequal(pol: str) -> bool:
    """A shipped policy whose (layer, KV head) rows keep unequal counts (``allocation=``: per-row pages)."""
    import vtoken_policies

    return not vtoken_policies.load(pol).spec.uniform


def row_when(cfg: ServeConfig, pol: str) -> str:
    """When a row's policy evicts: the config's ``when``, except ``"prefill"`` for an unequal policy (per-row
    pages take a request once, after its prompt: ``vtoken_runtime.eviction.refuse_unequal``)."""
    return "prefill" if unequal(pol) else cfg.when


def row_keys(cfg: ServeConfig) -> list[tuple[str, str, float]]:
    """The evicting rows ``(mode, policy, ratio)``: every mode, policy and ratio, except Naive-Evict rows of an
    unequal policy (Naive-Evict holds every block with a live token; it has no per-row pages)."""
    return [(m, p, r) for p in cfg.policies for r in cfg.ratios for m in cfg.modes
            if not (m == "naive" and unequal(p))]


def plugin_args(cfg: ServeConfig, pol: str, r: float, mode: str = "vtoken") -> dict[str, Any]:
    """The plugin settings of an evicting row: policy, mode, ratio, :func:`row_when` and the config's ``slack``."""
    return {"policy": pol, "mode": MODES[mode], "eviction_ratio": r, "when": row_when(cfg, pol), "slack": cfg.slack}
