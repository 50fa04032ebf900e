"""Helpers for the vLLM plugin tests: in-process engines, reaching the scheduler / model runner, and an
HF reference that replays exactly the key sets the engine attended (per layer and KV head)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
       "VLLM_USE_V2_MODEL_RUNNER": "0", "HF_HUB_OFFLINE": "1"}


def set_env() -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama vLLM's CPU backend accepts (head size 32, GQA 4:2, 2 layers, vocab 512)."""
    from vtoken_bench.models import tiny_llama

    if (path / "config.json").exists():
        return path
    m = tiny_llama(seed=seed, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2,
                   intermediate_size=256, vocab_size=512)
    m.config.torch_dtype = "float32"
    m.save_pretrained(str(path))
    return path


HYBRID_LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
HYBRID_WINDOW = 48


def make_tiny_hybrid(path: Path, seed: int = 0, layer_types: tuple[str, ...] = HYBRID_LAYERS) -> Path:
    """A tiny random Gemma 3 (text) with sliding-window layers (``layer_types``, window :data:`HYBRID_WINDOW`):
    vLLM gives it one KV cache group per attention type (head size 32, GQA 4:2, vocab 512)."""
    if (path / "config.json").exists():
        return path
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=len(layer_types),
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         sliding_window=HYBRID_WINDOW, layer_types=list(layer_types), bos_token_id=256,
                         eos_token_id=257, pad_token_id=257)
    torch.manual_seed(seed)
    m = Gemma3ForCausalLM(c)
    m.config.torch_dtype = "float32"
    m.save_pretrained(str(path))
    return path


def engine(model: str | Path, plugin: dict[str, Any] | None, *, max_model_len: int = 512, blocks: int = 64,
           max_num_seqs: int = 8, block_size: int = 32, tokenizer: bool = False, dtype: str = "float32",
           **kw: Any) -> Any:
    """An in-process vLLM ``LLM`` (eager; ``dtype`` float32 or bfloat16). ``plugin=None`` is vanilla vLLM;
    otherwise the kwargs of ``vllm_engine_args``. ``blocks`` sizes the KV cache through
    ``kv_cache_memory_bytes`` (``vtoken_bench.serve_engine.kv_bytes``, in the engine's dtype)."""
    set_env()
    from vllm import LLM

    from vtoken_bench.serve_engine import kv_bytes
    from vtoken_runtime.vllm_plugin import vllm_engine_args

    args: dict[str, Any] = dict(model=str(model), skip_tokenizer_init=not tokenizer, dtype=dtype,
                                max_model_len=max_model_len, block_size=block_size,
                                kv_cache_memory_bytes=kv_bytes(str(model), blocks, block_size, dtype),
                                enforce_eager=True,
                                max_num_seqs=max_num_seqs, seed=0, enable_prefix_caching=False)
    if plugin is not None:
        args.update(vllm_engine_args(**{**plugin, "slack": plugin.get("slack") or 0}))  # slack None: 0, as the references
    args.update(kw)
    return LLM(**args)


@contextlib.contextmanager
def cpu_async_scheduling() -> Iterator[None]:
    """Engines built inside keep ``async_scheduling=True``. vLLM's CPU platform switches asynchronous scheduling
    off in ``CpuPlatform.check_and_update_config`` ("async scheduling is not required on CPU"), one assignment;
    the engine's asynchronous path itself (``AsyncScheduler``, the engine core's batch queue, the V1 runner's
    ``AsyncGPUModelRunnerOutput``) runs on a CPU. This undoes that assignment while the engine's configuration is
    checked (in this process: in-process engines only), so the plugin is tested under vLLM's real asynchronous
    scheduling."""
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.__dict__["check_and_update_config"]

    def keep_async(cls: Any, vllm_config: Any) -> None:
        want = vllm_config.scheduler_config.async_scheduling
        orig.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = want

    CpuPlatform.check_and_update_config = classmethod(keep_async)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = orig  # type: ignore[method-assign]


def core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def scheduler(llm: Any) -> Any:
    return core(llm).scheduler


def runner(llm: Any) -> Any:
    ex = core(llm).model_executor
    w = ex.driver_worker
    return getattr(w, "worker", w).model_runner


def watch_runner_rows(llm: Any) -> dict[str, Any]:
    """After every state update of the runner: for each request in its persistent batch, its block-table row,
    ``requests[rid].block_ids`` and the scheduler manager's list must agree, and no block may be on two requests'
    rows (``bad`` lists what did not hold). Counts ``checked`` (rows of requests that have evicted) and
    ``rows_sent`` (rows the scheduler sent in ``vtoken_rows``)."""
    from vtoken_runtime.vllm_plugin.report import ROWS_ATTR

    sched, run = scheduler(llm), runner(llm)
    orig = run._update_states
    seen: dict[str, Any] = {"bad": [], "checked": 0, "rows_sent": 0}

    def wrapped(so: Any) -> Any:
        out = orig(so)
        ib = run.input_batch
        bt = ib.block_table[0]
        seen["rows_sent"] += len(getattr(so, ROWS_ATTR, None) or {})
        owners: dict[int, str] = {}
        for rid in list(ib.req_ids[: ib.num_reqs]):
            row = ib.req_id_to_index[rid]
            table = bt.block_table.np[row, : int(bt.num_blocks_per_row[row])].tolist()
            ids = list(run.requests[rid].block_ids[0])
            owner = list(sched.kv_cache_manager.get_block_ids(rid)[0])
            if not owner == ids == table:
                seen["bad"].append(f"{rid}: manager {owner}, block_ids {ids}, row {table}")
            for b in table:
                if owners.setdefault(b, rid) != rid:
                    seen["bad"].append(f"block {b} on the rows of {owners[b]} and {rid}")
            seen["checked"] += sched.evicted_tokens(rid) > 0
        return out

    run._update_states = wrapped
    return seen


def prompts(lengths: list[int], seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(3, vocab - 2, size=n).tolist() for n in lengths]


def generate(llm: Any, token_prompts: list[list[int]], max_tokens: int | list[int] = 24,
             extra: list[dict | None] | None = None) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n = len(token_prompts)
    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    sps = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                          extra_args=({"vtoken": extra[i]} if extra and extra[i] is not None else None))
           for i, m in enumerate(mts)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], sps, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# ---------------------------------------------------------------------------------------------- HF replay
_MASKS: dict[int, torch.Tensor] = {}


def _replay_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float, dropout: float = 0.0, **kw: Any) -> Any:
    """Eager attention with a per-(layer, KV head) boolean key mask ``[Hkv, Q, K]``."""
    from transformers.models.llama.modeling_llama import repeat_kv

    allow = _MASKS[module.layer_idx]  # [Hkv, Q, K]
    G = module.num_key_value_groups
    k = repeat_kv(key, G)
    v = repeat_kv(value, G)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling  # [1, Hq, Q, K]
    m = allow.repeat_interleave(G, dim=0)[None]
    w = w.masked_fill(~m, float("-inf"))
    p = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(p, v).transpose(1, 2).contiguous(), p


def replay_masks(trace: list[tuple[int, int, np.ndarray]], total: int, num_layers: int, num_kv_heads: int
                 ) -> dict[int, torch.Tensor]:
    """From the engine trace (per step: first position, query count, live positions per row including the
    step's own tokens: ``[R, n]``, or a list of R arrays of unequal lengths for a request in per-row pages) build ``{layer: [Hkv, total, total] bool}``: query i sees key j iff j was live
    when i was processed and j <= i. A trace that starts past position 0 is a request whose first tokens were
    prefix-cache hits: their K/V were computed, by the request that cached them, before any of its evictions
    (the frozen prefix, ``vllm_plugin/prefix.py``), so the replay computes them over the whole causal prefix."""
    allow = torch.zeros(num_layers, num_kv_heads, total, total, dtype=torch.bool)
    hit = min((s for s, _, _ in trace), default=0)
    allow[:, :, :hit, :hit] = torch.ones(hit, hit, dtype=torch.bool).tril()
    for start, n, pos in trace:
        R = len(pos)
        for q in range(start, start + n):
            for r in range(num_layers * num_kv_heads):
                p = pos[r if R > 1 else 0]
                p = p[p <= q]
                allow[r // num_kv_heads, r % num_kv_heads, q, torch.as_tensor(p)] = True
    return {li: allow[li] for li in range(num_layers)}


def hf_replay_logits(model_dir: str | Path, ids: list[int], masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of the HF model when each query attends exactly its replayed key set."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("vt_replay", _replay_attention)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="vt_replay").eval()
    _MASKS.clear()
    _MASKS.update(masks)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor([ids]), use_cache=False)
    return out.logits[0]


def segments(trace: list[tuple[int, int, np.ndarray]]) -> list[list[tuple[int, int, np.ndarray]]]:
    """Split a request's trace at recomputes (a step starting again at position 0 after a preemption)."""
    out: list[list[tuple[int, int, np.ndarray]]] = []
    for e in trace:
        if e[0] == 0 or not out:
            out.append([])
        out[-1].append(e)
    return out


def metric(name: str) -> float:
    """The in-process value of a ``vtoken_*`` Prometheus sample (``vtoken_blocks_freed_total``, ...), 0 before
    anything was counted (the default registry: in-process engines record there)."""
    from prometheus_client import REGISTRY

    from vtoken_runtime.vllm_plugin.metrics import counters

    counters()  # created once per process
    return float(REGISTRY.get_sample_value(name) or 0.0)


def hf_session_generate(policy: str, ratio: float, prompt: list[int], max_tokens: int, num_blocks: int
                        ) -> tuple[list[int], list[Any]]:
    """The shipped ``policy`` at eviction ratio ``ratio`` in the HF adapter on SmolLM2 (blocks of 32, the whole
    prompt in one chunk, kept sets recorded): ``(greedy tokens, the request's keep log)``."""
    import vtoken_policies
    from vtoken_bench.models import load_smollm2
    from vtoken_runtime.hf_adapter import HFSession

    model, _ = load_smollm2()
    pol = vtoken_policies.load(policy)
    pol = pol.configure(budget=pol.budget.model_copy(update={"ratio": ratio}))
    s = HFSession(model, block_size=32, num_blocks=num_blocks, stat_names=pol.stored_reads, chunk_size=len(prompt),
                  record_keeps=True)
    s.add("r", pol)
    out = s.generate(["r"], [prompt], max_tokens)[0]
    return out, s.requests["r"].keep_log


def replay_gap(model: str | Path, trace: dict[str, list], ps: list[list[int]], outs: list[list[int]], L: int,
                H: int, masks: Any = None) -> tuple[float, int]:
    """Worst logit gap between each engine token and the argmax of the HF replay over the kept rows, and the
    number of tokens checked. ``masks(segment, end)``: the replay's ``{layer: mask}`` (default
    :func:`replay_masks` over ``L`` layers of ``H`` KV heads)."""
    if masks is None:
        masks = lambda seg, end: replay_masks(seg, end, L, H)  # noqa: E731
    rids = sorted(trace, key=lambda r: int(r.split("-")[0]))
    worst, checked = 0.0, 0
    for rid, p, o in zip(rids, ps, outs, strict=True):
        ids = p + o[:-1]
        for seg in segments(trace[rid]):
            end = max(s + n for s, n, _ in seg)
            lg = hf_replay_logits(model, ids[:end], masks(seg, end))
            for s, n, _ in seg:
                t = s + n - len(p)
                if 0 <= t < len(o):
                    row = lg[s + n - 1]
                    if not bool(torch.isfinite(row).all()):  # a query with no key: the replay is not a check
                        raise AssertionError(f"request {rid}: the HF replay's logits at {s + n - 1} are not finite")
                    worst = max(worst, float(row.max() - row[o[t]]))
                    checked += 1
    return worst, checked


# ------------------------------------------------------------------------------ multi-process engines (TP, PP)
def _start_trace(worker: Any) -> bool:  # runs in each worker process (collective_rpc)
    worker.model_runner.vtoken_trace = {}
    return True


def _trace(worker: Any) -> dict:  # keyed by the request's index in the generate call (ids carry a random suffix)
    return {rid.split("-")[0]: [(s, n, p.tolist() if isinstance(p, np.ndarray) else [x.tolist() for x in p])
                                for s, n, p in steps]
            for rid, steps in worker.model_runner.vtoken_trace.items()}


def traced_run(model: str | Path, plugin: dict[str, Any], ps: list[list[int]], max_tokens: int = 20,
               **kw: Any) -> tuple[list[list[int]], list[dict]]:
    """Greedy outputs of ``ps`` on an engine with the vToken ``plugin`` (``kw``: engine arguments, e.g.
    ``tensor_parallel_size``), and every worker's trace (one per rank, in rank order), the engine shut down."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a test function
    llm = engine(model, plugin, **kw)
    try:
        llm.collective_rpc(_start_trace)
        outs = generate(llm, ps, max_tokens=max_tokens)
        traces = llm.collective_rpc(_trace)
    finally:
        del llm
        import gc

        gc.collect()
    return outs, traces
