import torch

import vtoken_sdk as vt


@vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
def flat(s: vt.TokenStats, ctx: vt.MaskContext):  # EXPECT score_shape
    b, l_, h, n = ctx.shape
    return torch.ones(b, n, dtype=torch.bool)
