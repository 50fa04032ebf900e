import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    if s.attn_sum > 0.5:  # EXPECT definition
        return s.attn_sum
    return s.key_norm
