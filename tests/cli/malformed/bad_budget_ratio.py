import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=1.5))  # EXPECT definition
def p(s: vt.TokenStats):
    return s.attn_sum
