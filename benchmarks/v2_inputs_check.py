"""Model Runner V2's input preparation with vToken's step rewrite (``vtoken_runtime.vllm_plugin.runner_v2``),
over V2's real classes and kernels.

``python -m vtoken_bench.v2_inputs_check [--steps N] [--layout LBHNC] [--mutate no-restore|no-rows|no-slots]``

A V2 ``GPUModelRunner`` cannot be constructed without CUDA (streams in its constructor), so the runner here is
V2's class with the rewrite mixin, built by hand around V2's own ``RequestState``, ``InputBuffers`` and
``BlockTables`` (vLLM's fallback buffers for platforms without pinned memory). Its real methods run each step:
``finish_requests``, ``add_requests``, ``update_requests``, ``BlockTables.apply_staged_writes``,
``gather_batch_req_state``, ``prepare_inputs`` (``prepare_prefill_inputs``, ``prepare_pos_seq_lens``,
``combine_sampled_and_draft_tokens``) and ``prepare_attn`` (``gather_block_tables``, ``compute_slot_mappings``),
with their Triton kernels (compiled on CUDA, under the Triton interpreter here). Emulated: the scheduler (blocks
by cache length, truncated lists in ``SchedulerOutput.vtoken_rows`` after an eviction, freed blocks handed to a
later request, a request starting with a prefix-cache hit on another's block), the forward (K/V written through the step's slot mapping into views made by vLLM's
``create_kv_cache_views``), the sampler (a probe in its place calls V2's ``get_num_sampled_and_rejected`` on the
lengths the sampler reads) and the device update of ``num_computed_tokens`` after sampling.

Checked every step: positions are true positions; the slot mapping is the token table's slot of every new token;
the gathered block tables are the scheduler's rows; ``seq_lens`` at attention time are the cache lengths and
attention over V2's block tables and lengths equals dense attention over each query's kept keys; the sampler sees
true lengths (one token per request past its prompt, none mid-prompt). Prints one JSON line; exit 0 on pass.
``--mutate`` removes one part of the rewrite (the check must then fail).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from types import SimpleNamespace
from typing import Any

L, H, G, D, BS, NB, MAX_REQS, MAX_TOKENS = 2, 2, 2, 32, 16, 48, 8, 256


class _Sink:
    """Takes writes and drops them (the ``no-rows`` mutation's block tables)."""

    np = None

    def __init__(self) -> None:
        self.np = self

    def stage_write(self, *a: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _runner(dev: Any, rewrite: Any, mutate: str | None, sampled: list) -> Any:
    import vllm.v1.worker.gpu.buffer_utils as bu

    bu.is_uva_available = lambda: False  # vLLM's own fallback for platforms without pinned memory
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBuffers, get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.states import RequestState

    from vtoken_runtime.vllm_plugin.runner_v2 import VTokenV2InputsMixin

    class SamplerProbe(GPUModelRunner):  # stands in for V2's sampler: the lengths it reads
        def sample(self, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
            import torch

            ones = torch.ones(input_batch.num_reqs, dtype=torch.int32)
            n, _ = get_num_sampled_and_rejected(ones, input_batch.seq_lens[:input_batch.num_reqs],
                                                input_batch.cu_num_logits, input_batch.idx_mapping,
                                                self.req_states.prefill_len.gpu)
            sampled.append(n.tolist())

    class Runner(VTokenV2InputsMixin, SamplerProbe):
        pass

    r = object.__new__(Runner)
    max_blocks = NB
    ns = SimpleNamespace
    r.__dict__.update(
        device=dev, max_num_reqs=MAX_REQS, decode_query_len=1, use_pp=False, is_last_pp_rank=False,
        adaptive_verification=None, fast_prefill=None, pcp_manager=None, pooling_runner=None, pp_handler=None,
        encoder_cache=None, prompt_logprobs_worker=None, sampler=None, kv_block_zeroer=None,
        model_config=ns(rswa_window=None),
        model_state=ns(num_new_sampled_tokens_per_step=1, remove_request=lambda rid: None,
                       add_request=lambda i, d: None, apply_staged_writes=lambda: None),
        lora_state=ns(remove_request=lambda rid: None, add_request=lambda *a: None),
        input_buffers=InputBuffers(MAX_REQS, MAX_TOKENS, dev),
        req_states=RequestState(MAX_REQS, 512, MAX_TOKENS, 0, 128, dev),
        block_tables=BlockTables([BS], MAX_REQS, MAX_TOKENS, [max_blocks], dev))
    r._vt_v2 = rewrite
    if mutate == "no-rows":  # the truncated lists never reach V2's block tables (the host copy still follows)
        update = rewrite.update
        rewrite.update = lambda so, bt, idx: update(so, SimpleNamespace(block_tables=[_Sink()], num_blocks=_Sink()),
                                                    idx)
    if mutate == "no-slots":
        rewrite.rewrite_slots = lambda sm: None
    if mutate == "no-restore":
        rewrite.restore_lengths = lambda ib: None
    return r


def run(steps: int = 16, layout: str = "LBHNC", mutate: str | None = None, seed: int = 0) -> dict[str, Any]:
    from vtoken_bench.gpu_rows_check import _setup, vllm_kv_views

    dev, interpreted = _setup()
    import numpy as np
    import torch
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from vtoken_runtime.cache import VTokenCache
    from vtoken_runtime.kv_layout import KVLayoutAdapter, LayoutCopyEngine
    from vtoken_runtime.paged_attention import paged_attention
    from vtoken_runtime.vllm_plugin.runner_v2 import V2StepRewrite
    from vtoken_runtime.vllm_plugin.step_inputs import true_positions
    from vtoken_runtime.vllm_plugin.worker import ExternalPool

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 1)
    views = vllm_kv_views(layout, L, NB, H, D, BS, torch.float32)
    adapters = [KVLayoutAdapter.from_view(v, D) for v in views]
    pool = ExternalPool(NB)
    cache = VTokenCache(L, H, D, BS, NB, granularity="head", mode="compact", dtype=torch.float32, kv_caches=views,
                        async_copy=True, pool=pool, max_requests=MAX_REQS,
                        kv_views=[a.kv_views(v) for a, v in zip(adapters, views, strict=True)],
                        copy_engine=lambda *a, **k: LayoutCopyEngine(*a, adapters=adapters, **k))
    rewrite = V2StepRewrite(cache, pool, cache.add_request, MAX_REQS, dev, cached_prefix=True)
    sampled: list[list[int]] = []
    runner = _runner(dev, rewrite, mutate, sampled)

    # the scheduler: prompts arrive, c finishes after 4 decode steps and d takes blocks c freed; e starts with a
    # prefix-cache hit on p's first block (p is never evicted; e pins the 16 cached tokens)
    prompts = {"a": 70, "b": 41, "c": 23, "p": 20}
    decode_left = {"a": 99, "b": 99, "c": 4, "d": 99, "p": 99, "e": 99}
    hits = {"e": ("p", BS)}
    free = list(range(1, NB))  # block 0: vLLM's null block
    rows: dict[str, list[int]] = {}  # the scheduler's block list per request
    shrunk: dict[str, list[int]] = {}  # truncated since the last step: sent as SchedulerOutput.vtoken_rows
    dense: dict[str, dict[int, list]] = {}
    finishing: set[str] = set()
    freed_by_finished: set[int] = set()
    failures: list[str] = []
    checks = {"steps": 0, "tokens": 0, "evictions": 0, "attention_rows": 0, "sampled": 0, "rows_sent": 0,
              "reused_blocks": 0, "prefix_hit_tokens": 0}
    max_err = 0.0

    def fail(msg: str) -> None:
        if len(failures) < 8:
            failures.append(msg)

    for step in range(steps):
        if step == 5:  # the step the runner hears that c finished
            prompts["d"] = 37
        if step == 8:
            prompts["e"] = 48
        new_reqs, cached, n_sched, new_blocks = [], [], {}, {}
        for rid, plen in prompts.items():
            if rid in finishing:
                continue
            hit = hits[rid][1] if rid in hits and rid not in dense else 0
            done = cache.logical_len(rid) if cache.has_request(rid) else hit
            n = min(32, plen - done) if done < plen else 1
            used = cache.cache_len(rid) if cache.has_request(rid) else hit
            row = rows.setdefault(rid, rows[hits[rid][0]][:hit // BS] if hit else [])
            add = []
            while (len(row) + len(add)) * BS < used + n:
                add.append(free.pop(0))
            n_sched[rid] = n
            row += add
            if rid not in dense:
                dense[rid] = {x: dense[hits[rid][0]][x] for x in range(hit)}  # the cached tokens' K/V
                checks["reused_blocks"] += len(freed_by_finished & set(row))
                checks["prefix_hit_tokens"] += hit
                new_reqs.append(NewRequestData(rid, list(range(plen)), [], None, None, (list(row),), hit, None,
                                               prefill_token_ids=list(range(plen))))
            else:
                cached.append(rid)
                new_blocks[rid] = add
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=cached, resumed_req_ids=set(), new_token_ids=[[] for _ in cached], all_token_ids={},
                new_block_ids=[(new_blocks[r],) if new_blocks[r] else None for r in cached],
                num_computed_tokens=[cache.logical_len(r) for r in cached], num_output_tokens=[0 for _ in cached]),
            num_scheduled_tokens=n_sched, total_num_scheduled_tokens=sum(n_sched.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(finishing),
            free_encoder_mm_hashes=[])
        so.vtoken_rows = {r: ids for r, ids in shrunk.items() if r in n_sched}  # type: ignore[attr-defined]
        checks["rows_sent"] += len(so.vtoken_rows)  # type: ignore[attr-defined]
        for r in finishing:
            prompts.pop(r)
        finishing, shrunk = set(), {}

        # -- V2's step, with the rewrite
        runner.finish_requests(so)
        runner.add_requests(so)
        runner.update_requests(so)
        runner.block_tables.apply_staged_writes()
        brs, _ = runner.gather_batch_req_state(so, False)
        desc = SimpleNamespace(num_tokens=brs.num_tokens, num_reqs=None)
        ib = runner.prepare_inputs(so, brs, desc, 0)
        bts, sms = runner.prepare_attn(ib)
        B, T = ib.num_reqs, ib.num_tokens
        rids = list(ib.req_ids)
        n = np.asarray(ib.num_scheduled_tokens[:B])
        qsl = ib.query_start_loc_np[:B + 1]
        computed = np.asarray(ib.num_computed_tokens_np[:B])
        checks["steps"] += 1
        checks["tokens"] += T
        pos = ib.positions[:T].numpy()
        if not np.array_equal(pos, true_positions(computed, n)):
            fail(f"step {step}: positions are not the true positions")
        slots = sms[0, :T].numpy()
        want_len = [cache.cache_len(r) for r in rids]
        if ib.seq_lens[:B].tolist() != want_len:
            fail(f"step {step}: seq_lens {ib.seq_lens[:B].tolist()} at attention time, cache lengths {want_len}")
        for i, r in enumerate(rids):
            p, phys = cache.live_slots(r)
            at = dict(zip(p.tolist() if p.ndim == 1 else p[0].tolist(), phys.tolist() if phys.ndim == 1 else
                          phys[0].tolist(), strict=True))
            got = slots[qsl[i]:qsl[i + 1]].tolist()
            if got != [at.get(int(x)) for x in pos[qsl[i]:qsl[i + 1]]]:
                fail(f"step {step}: request {r}: slot mapping {got[:4]}... is not the token table's")
            nb = int(runner.block_tables.num_blocks.np[0, runner.req_states.req_id_to_index[r]])
            if bts[0][i, :nb].tolist() != rows[r] or nb != len(rows[r]):
                fail(f"step {step}: request {r}: V2's block table {bts[0][i, :nb].tolist()} != scheduler row {rows[r]}")
        # -- the forward: K/V through the slot mapping, attention over V2's tables and lengths
        q = torch.randn(L, T, H * G, D)
        Q = int(n.max())
        qpos = torch.full((B, Q), -1, dtype=torch.int64)
        for layer in range(L):
            k, v = torch.randn(T, H, D), torch.randn(T, H, D)
            s = torch.as_tensor(slots)
            ok = s >= 0
            view = views[layer]
            view[s[ok] // BS, :, s[ok] % BS, :D] = k[ok]
            view[s[ok] // BS, :, s[ok] % BS, D:] = v[ok]
            for t in range(T):
                rid = rids[int(np.searchsorted(qsl, t, side="right") - 1)]
                dense[rid].setdefault(int(pos[t]), [None] * L)[layer] = (k[t], v[t])
            kc, vc = view.transpose(1, 2).split(D, dim=-1)
            qb = torch.zeros(B, Q, H * G, D)
            for i in range(B):
                a, e = int(qsl[i]), int(qsl[i + 1])
                qb[i, : e - a] = q[layer, a:e]
                qpos[i, : e - a] = torch.as_tensor(pos[a:e])
            out, _ = paged_attention(qb, kc, vc, bts[0][:B].long(), ib.seq_lens[:B].long(), qpos)
            for i, r in enumerate(rids):
                live = cache.live_view(r)[0]
                for j in range(int(n[i])):
                    p_ = int(qpos[i, j])
                    for h in range(H):
                        keys = sorted(int(x) for x in live[layer * H + h] if x <= p_)
                        K = torch.stack([dense[r][x][layer][0][h] for x in keys])
                        V = torch.stack([dense[r][x][layer][1][h] for x in keys])
                        qh = qb[i, j, h * G:(h + 1) * G]
                        ref = torch.softmax(qh @ K.T / math.sqrt(D), -1) @ V
                        max_err = max(max_err, float((out[i, j, h * G:(h + 1) * G] - ref).abs().max()))
                        checks["attention_rows"] += 1
        # -- sampling (the probe reads the lengths V2's sampler reads), then V2's device update
        runner.sample(None, ib, None)
        want = [int(c + k >= prompts[r]) for r, c, k in zip(rids, computed, n, strict=True)]
        if sampled[-1] != want:
            fail(f"step {step}: sampled {sampled[-1]}, expected {want} (one per request past its prompt)")
        else:
            checks["sampled"] += sum(want)
        idx = ib.idx_mapping_np[:B]
        runner.req_states.num_computed_tokens.gpu[torch.as_tensor(idx)] += torch.as_tensor(n, dtype=torch.int32)
        # -- the runner's eviction (random ~30% of each row, newest kept) and the scheduler's truncation
        done_blocks: list[int] = []
        for i, r in enumerate(rids):
            past = int(computed[i] + n[i]) >= prompts[r]
            if past:
                decode_left[r] -= 1
                if decode_left[r] < 0:  # finished: its blocks go back now, the runner hears it next step
                    finishing.add(r)
                    freed_by_finished |= set(rows[r])
                    done_blocks += rows.pop(r)
                    continue
            live_n = cache.live_tokens(r)
            if not past or live_n < 8 or r == "p":
                continue
            keep = np.ones((L * H, live_n), dtype=bool)
            live_pos = cache.live_view(r)[0]
            pinned = hits[r][1] if r in hits else 0  # a prefix-cache hit stays (the worker freezes it, decision 9)
            for row_ in range(L * H):
                cand = np.flatnonzero(live_pos[row_, :-1] >= pinned)  # the newest is kept
                keep[row_, rng.choice(cand, size=min(live_n * 3 // 10, live_n - 1 - pinned), replace=False)] = False
            cache.apply_keep_mask(r, keep)
            checks["evictions"] += 1
        cache.reclaim()
        for r in rids:
            if r in rows:
                k_ = -(-cache.cache_len(r) // BS)
                if k_ < len(rows[r]):
                    free[:0] = rows[r][k_:]
                    del rows[r][k_:]
                    shrunk[r] = list(rows[r])
        free[:0] = done_blocks  # a finished request's blocks are handed out first (to d)
        cache.check_invariants()
    checks["max_abs_err"] = max_err
    ok = (not failures and max_err <= 1e-4 and checks["evictions"] > 0 and checks["rows_sent"] > 0
          and checks["reused_blocks"] > 0 and checks["prefix_hit_tokens"] > 0)
    return {"device": str(dev), "interpreted": interpreted, "layout": layout, "mutate": mutate, "checks": checks,
            "failures": failures, "pass": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layout", default="LBHNC", choices=["LBNHC", "LBHNC"])
    ap.add_argument("--mutate", choices=["no-restore", "no-rows", "no-slots"])
    a = ap.parse_args(argv)
    try:
        res = run(a.steps, a.layout, a.mutate)
    except Exception as e:  # a broken rewrite may fail inside vLLM's code: a failed check, not a crash
        res = {"layout": a.layout, "mutate": a.mutate, "error": f"{type(e).__name__}: {e}", "pass": False}
    print(json.dumps(res))
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
