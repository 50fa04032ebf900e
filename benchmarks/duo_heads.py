"""Retrieval heads of SmolLM2 for a DuoAttention-style policy (``policies/duo_attention.py``): the procedure.

DuoAttention (Xiao et al., arXiv:2410.10819) splits KV heads into *retrieval* heads (keep the whole
context) and *streaming* heads (keep sinks + recent tokens), learning the split with gates trained on
synthetic passkey data. No training here: the split is the retrieval score of Wu et al., "Retrieval Head
Mechanistically Explains Long-Context Factuality" (arXiv:2404.15574), in its attention-mass form, which
needs one forward per prompt:

1. ``prompts`` passkey prompts of ``length`` tokens from the essay corpus (``vtoken_bench.essays``), the
   needle at depths spread over (0.05, 0.95), passkeys and filler offsets from ``seed``;
2. each prompt is followed by its true answer (`` N``, teacher forcing) and run once through SmolLM2 in
   float32 with eager attention (``output_attentions``);
3. a KV head's score is the attention mass its query heads (mean over the GQA group) put on the needle's
   tokens from the queries that predict the answer's tokens, averaged over those queries and the prompts;
4. the ``fraction`` of KV heads with the highest scores are retrieval heads (ties: the lower row).

    python -m vtoken_bench.duo_heads            # prints the JSON report; --json FILE writes it

Deterministic (fixed seeds, one float32 forward per prompt on CPU); ``policies/duo_attention.py`` holds
the result as a literal, ``tests/bench/test_duo_heads.py`` checks the two agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

DEFAULTS = {"prompts": 8, "length": 1024, "seed": 0, "fraction": 0.25}


def head_scores(model: Any, tok: Any, prompts: int, length: int, seed: int) -> torch.Tensor:
    """``[L, H_kv]`` float64: the mean attention mass on the needle from the answer's queries (module doc)."""
    from vtoken_bench.essays import build_passkey

    cfg = model.config
    L, hq, hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    total = torch.zeros(L, hkv, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    for i in range(prompts):
        passkey = int(torch.randint(10000, 99999, (1,), generator=g))
        depth = 0.05 + 0.9 * i / max(1, prompts - 1)
        p = build_passkey(tok, length, depth, passkey, filler_offset=int(torch.randint(0, 20000, (1,), generator=g)))
        answer = tok.encode(f" {passkey}", add_special_tokens=False)
        ids = p.input_ids + answer
        q0 = len(p.input_ids) - 1  # the query that predicts the answer's first token
        qs = slice(q0, q0 + len(answer))
        a, b = p.needle_span
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
        for li, att in enumerate(out.attentions):  # [1, Hq, T, T]
            mass = att[0, :, qs, a:b].sum(-1).mean(-1).to(torch.float64)  # [Hq]
            total[li] += mass.view(hkv, hq // hkv).mean(-1)
    return total / prompts


def retrieval_heads(scores: torch.Tensor, fraction: float) -> list[list[int]]:
    """The top ``fraction`` of ``[L, H]`` by score (at least one), ties to the lower row, as sorted ``[l, h]``."""
    L, H = scores.shape
    n = max(1, round(fraction * L * H))
    flat = scores.flatten().tolist()
    order = sorted(range(L * H), key=lambda r: (-flat[r], r))[:n]
    return sorted([r // H, r % H] for r in order)


def run(prompts: int = 8, length: int = 1024, seed: int = 0, fraction: float = 0.25) -> dict[str, Any]:
    from vtoken_bench.models import load_smollm2

    torch.manual_seed(0)
    model, tok = load_smollm2(attn_implementation="eager")
    s = head_scores(model, tok, prompts, length, seed)
    return {"model": "SmolLM2-135M-Instruct", "procedure": "vtoken_bench.duo_heads (module doc)",
            "prompts": prompts, "length": length, "seed": seed, "fraction": fraction,
            "num_layers": s.shape[0], "num_kv_heads": s.shape[1], "retrieval": retrieval_heads(s, fraction),
            "scores": [[round(x, 6) for x in row] for row in s.tolist()]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    rep = run(a.prompts, a.length, a.seed, a.fraction)
    text = json.dumps(rep, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
