"""Random-weight tiny target/draft pairs built in the test process (real Qwen3 + real DFlashDraftModel).

Random weights alone make the draft and target agree almost never (tau ~ 1), which would leave the
acceptance bookkeeping untested. So the shared lm_head is tilted: two tokens get a large +/- component along
one direction u, and every other row is shrunk. Each model's argmax is then decided by the sign of its final
hidden state along u: the draft agrees with the target about half the time, and acceptance lengths vary.
"""

import torch
from dflash.model import DFlashDraftModel
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 64
MASK_ID = VOCAB - 1
EOS_ID = VOCAB - 2


def make_pair(seed: int, block_size: int = 4, tilt: float = 0.3, shrink: float = 1.0, target_layers: int = 3):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=target_layers, tie_word_embeddings=False,
                                          eos_token_id=EOS_ID, **common)).eval()
    draft_cfg = Qwen3Config(num_hidden_layers=1, num_target_layers=target_layers, **common)
    draft_cfg.dflash_config = {"block_size": block_size, "mask_token_id": MASK_ID,
                               "target_layer_ids": [0, target_layers - 1]}
    draft = DFlashDraftModel(draft_cfg).eval()
    with torch.no_grad():
        w = target.lm_head.weight
        u = torch.randn(w.shape[1])
        u /= u.norm()
        w.mul_(shrink)
        w[3] += tilt * u
        w[4] -= tilt * u
    return target, draft


def prompt(seed: int, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, VOCAB - 2, (1, length), generator=g)
