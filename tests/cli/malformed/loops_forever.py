"""Never finishes importing: `vtoken-cli validate --timeout` stops it and names this line."""

import vtoken_sdk as vt

n = 0
while n >= 0: n += 1  # EXPECT load


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    return s.attn_sum
