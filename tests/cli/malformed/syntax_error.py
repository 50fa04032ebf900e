import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def broken(s: vt.TokenStats)  # EXPECT load
    return s.attn_sum
