import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5, tokens=128))  # EXPECT definition
def p(s: vt.TokenStats):
    return s.attn_sum
