import torch

import vtoken_sdk as vt


@vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",), protect=[vt.sinks(4)])
def drops_pin(s: vt.TokenStats, ctx: vt.MaskContext):  # EXPECT pins_kept
    # keeps the top-k scores but forgets the pins
    b, l_, h, n = ctx.shape
    valid = torch.arange(n) < ctx.lengths[:, None, None, None]
    score = torch.where(valid, s.attn_sum.nan_to_num(nan=-1e30), torch.tensor(float("-inf")))
    rank = score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return (rank < ctx.keep_count[:, None, None, None]) & valid
