"""Never finishes importing, inside C code that never releases the GIL: the timeout still fires."""

import itertools

import vtoken_sdk as vt

total = sum(itertools.count())  # EXPECT load


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    return s.attn_sum
