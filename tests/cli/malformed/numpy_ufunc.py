import numpy as np

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    return np.log(s.attn_sum + 1.0)  # EXPECT definition
