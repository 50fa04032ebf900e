import torch

import vtoken_sdk as vt


@vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("key_norm",))
def keep_small_keys(s: vt.TokenStats, ctx: vt.MaskContext):  # EXPECT exact_budget
    valid = torch.arange(ctx.shape[-1]) < ctx.lengths[:, None, None, None]
    return (s.key_norm < 1.0) & valid
