import vtoken_sdk as vt


@vt.mask_policy(budget=vt.Budget(ratio=0.5), reads=("attn_sum",))
def crash(s: vt.TokenStats, ctx: vt.MaskContext):
    return s.attn_sum.reshape(-1, 7)  # EXPECT score_shape
