import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5), granularity="head",
           allocation=vt.AdaptiveLayer(floor=2.0))  # EXPECT definition
def p(s: vt.TokenStats):
    return s.attn_sum
