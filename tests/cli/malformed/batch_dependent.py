import torch

import vtoken_sdk as vt


@vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
def batch_norm(s: vt.TokenStats, ctx: vt.MaskContext):  # EXPECT batch_invariant
    # ranks tokens relative to the *batch* mean: another request changes this one's mask
    valid = torch.arange(ctx.shape[-1]) < ctx.lengths[:, None, None, None]
    x = s.attn_sum.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    m = x[valid.expand_as(x)].mean() if valid.any() else torch.tensor(0.0)
    score = torch.where(x > m, x, -x)
    score = torch.where(ctx.pins, torch.tensor(float("inf")), score)
    score = torch.where(valid, score, torch.tensor(float("-inf")))
    rank = score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return (rank < ctx.keep_count[:, None, None, None]) & valid
