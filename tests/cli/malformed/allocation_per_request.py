import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), allocation=vt.Pyramid())  # EXPECT definition
def p(s: vt.TokenStats):
    return s.attn_sum
