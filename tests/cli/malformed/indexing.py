import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    return s.attn_sum[..., :16]  # EXPECT definition
