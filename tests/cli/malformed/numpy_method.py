import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    scores = s.attn_sum.numpy()  # EXPECT definition
    return scores / scores.max()
