import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    s.attn_sum.sigmoid()  # EXPECT definition
