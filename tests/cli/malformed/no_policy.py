import vtoken_sdk as vt  # EXPECT load


def score(s: vt.TokenStats):
    return s.attn_sum
