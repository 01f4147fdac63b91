"""report's val confusion table over a policy's actions: a rule action's b_max (here 10) need not be a candidate
(7..9). Before, the table indexed the chosen b among the candidates and report crashed with "10 is not in list"
(found by gpu_check's CPU dry run once it evaluated at c = 1 alone)."""

import torch
from torch import nn

from pipeline.policy.blocksize import BlockSizePolicy
from stages.report import confusion


def test_a_rule_action_outside_the_candidates_gets_its_own_column():
    head = nn.Linear(4, 4, bias=False)  # 3 candidates + 1 rule action; a classifier (no fallback): the argmax
    with torch.no_grad():
        head.weight.copy_(torch.eye(4))
    policy = BlockSizePolicy(head, [7, 8, 9], 4, info={"rule_actions": [{"rule": "threshold:0.05",
                                                                         "max_block_size": 10}]})
    logits = torch.eye(4)[[0, 3, 3, 1]]  # chooses b=7, the rule at b_max 10 twice, b=8
    cm, names = confusion(policy, logits, [7, 8, 9, 8])
    assert names == ["b=7", "b=8", "b=9", "threshold:0.05@10"]
    assert cm.tolist() == [[1, 0, 0, 0],   # label 7: chose b=7
                           [0, 1, 0, 1],   # label 8: the rule once, b=8 once
                           [0, 0, 0, 1]]   # label 9: the rule
