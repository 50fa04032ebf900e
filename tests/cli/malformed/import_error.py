import vtoken_sdk.does_not_exist  # EXPECT load  # noqa: F401

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    return s.attn_sum
