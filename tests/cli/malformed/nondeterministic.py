import torch

import vtoken_sdk as vt


@vt.mask_policy(budget=vt.Budget(ratio=0.5))
def coin(s: vt.TokenStats, ctx: vt.MaskContext):  # EXPECT deterministic
    b, l_, h, n = ctx.shape
    valid = torch.arange(n) < ctx.lengths[:, None, None, None]
    noise = torch.where(ctx.pins, torch.tensor(2.0), torch.rand(b, l_, h, n))
    noise = torch.where(valid, noise, torch.tensor(-1.0))
    rank = noise.argsort(dim=-1, descending=True).argsort(dim=-1)
    return (rank < ctx.keep_count[:, None, None, None]) & valid
