import torch

import vtoken_sdk as vt


@vt.policy(budget=vt.Budget(ratio=0.5))
def p(s: vt.TokenStats):
    return torch.topk(s.attn_sum, 8)  # EXPECT definition
