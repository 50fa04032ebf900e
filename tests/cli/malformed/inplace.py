import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    x = s.attn_sum
    x += s.attn_last  # EXPECT definition
    return x
