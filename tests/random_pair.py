"""Random-weight tiny target/draft pairs built in the test process (real Qwen3 + real DFlashDraftModel).

Random weights alone make the draft and target agree almost never (tau ~ 1), which would leave the
acceptance bookkeeping untested. So the shared lm_head is tilted: two tokens get a large +/- component along
one direction u, and every other row is shrunk. Each model's argmax is then decided by the sign of its final
hidden state along u: the draft agrees with the target about half the time, and acceptance lengths vary.

Draft variants (keyword options of :func:`make_pair`, defaults = the plain one-layer full-attention draft):
``layer_types`` + ``sliding_window`` (sliding-window layers), ``is_causal`` (causal draft attention) and
``dflash2`` (a DFlash2DraftModel: causal convolutions around every layer and a top-k candidate selector).
"""

import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 64
MASK_ID = VOCAB - 1
EOS_ID = VOCAB - 2


def make_pair(seed: int, block_size: int = 4, tilt: float = 0.3, shrink: float = 1.0, target_layers: int = 3,
              layer_types=None, sliding_window=None, is_causal=None, dflash2: bool = False,
              conv_kernel_size: int = 3):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=target_layers, tie_word_embeddings=False,
                                          eos_token_id=EOS_ID, **common)).eval()
    variant = {}
    if layer_types is not None:
        # Qwen3Config drops sliding_window unless use_sliding_window is set.
        variant = dict(layer_types=list(layer_types), sliding_window=sliding_window,
                       use_sliding_window=sliding_window is not None)
    draft_cfg = Qwen3Config(num_hidden_layers=len(layer_types or [None]), num_target_layers=target_layers,
                            **variant, **common)
    if is_causal is not None:
        draft_cfg.is_causal = is_causal
    draft_cfg.dflash_config = {"block_size": block_size, "mask_token_id": MASK_ID,
                               "target_layer_ids": [0, target_layers - 1]}
    if dflash2:
        # Kernel 3: offsets up to 2 reach across neighbouring blocks when blocks lie side by side, and dflash's
        # convolution still runs on the shortest block the engine drafts (2 tokens; a longer kernel fails there).
        draft_cfg.dflash_config.update(conv_kernel_size=conv_kernel_size, conv_group_size=8, selector_rank=8,
                                       selector_top_k=6)
        draft_cfg.architectures = ["DFlash2DraftModel"]
        draft = DFlash2DraftModel(draft_cfg).eval()
        with torch.no_grad():  # the conv kernels are created with torch.empty and post_init leaves them alone
            for layer in draft.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.normal_(0.0, 0.3)
                    conv.kernel_projection.weight.normal_(0.0, 0.1)
            draft.candidate_selector.predecessor_codebook.weight.normal_(0.0, 1.0)
            draft.candidate_selector.successor_codebook.weight.normal_(0.0, 1.0)
    else:
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


QWEN3_VOCAB = 151936


def save_wide_pair(folder, hidden: int = 32, seed: int = 0):
    """A random Qwen3 target + DFlash draft with Qwen3's vocabulary (V = 151,936; narrow otherwise: ``hidden``),
    saved as checkpoints the loader reads (``folder/target``, ``folder/draft``); the lm_head is tilted as above so
    that acceptance varies. The V = 151,936 test (tests/unit/test_batched.py) and benchmarks/label_wide_vocab.py."""
    from pathlib import Path

    folder = Path(folder)
    torch.manual_seed(seed)
    heads = max(2, hidden // 64)
    common = dict(vocab_size=QWEN3_VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-6)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, tie_word_embeddings=True,
                                          eos_token_id=QWEN3_VOCAB - 2, **common)).eval()
    draft_cfg = Qwen3Config(num_hidden_layers=1, num_target_layers=2, **common)
    draft_cfg.dflash_config = {"block_size": 4, "mask_token_id": QWEN3_VOCAB - 1, "target_layer_ids": [0, 1]}
    draft = DFlashDraftModel(draft_cfg).eval()
    with torch.no_grad():
        w = target.lm_head.weight
        u = torch.randn(w.shape[1])
        w[3] += 0.3 * u / u.norm()
        w[4] -= 0.3 * u / u.norm()
    target.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    return folder / "target", folder / "draft"


def learned_rule(b_max: int, slope: float = 0.15, w_conf: float = 0.5, w_prev: float = 0.4, intercept: float = 2.0,
                 rate: float = 0.0):
    """A pipeline.policy.step_rules.LearnedVerify with hand-set weights (not fitted: the exactness tests need a
    rule that cuts at varied lengths, whatever a fit would give) over step seconds 1 + slope x k; ``rate`` > 0 picks k
    by expected tokens net of rate x seconds, 0 by their ratio."""
    from pipeline.policy.acceptance import FEATURES, AcceptanceModel
    from pipeline.policy.step_rules import LearnedVerify

    weights = tuple(w_conf if f == "log_confidence" else w_prev if f == "previous_accepted" else 0.0
                    for f in FEATURES)
    model = AcceptanceModel(intercept, weights, (0.0,) * len(FEATURES), (1.0,) * len(FEATURES), FEATURES, b_max)
    return LearnedVerify(model, tuple(1.0 + slope * k for k in range(1, b_max)), rate)


ZLAB_MASK_ID = 151669  # the z-lab Qwen3 DFlash drafts' mask token (<|MASK|>, added after Qwen3's own tokens)


def save_real_shaped_pair(folder, hidden: int = 64, target_layers: int = 6, draft_layers: int = 2, seed: int = 0):
    """A random Qwen3 target at Qwen3's vocabulary (V = 151,936) and a DFlash draft whose config.json has the z-lab
    DFlash-b16 layout: ``architectures`` DFlashDraftModel, ``block_size`` 16, ``num_target_layers``, and
    ``dflash_config`` with ``mask_token_id`` (z-lab's 151,669) and ``target_layer_ids`` (dflash's own evenly spaced
    choice, as z-lab's [1, 9, 17, 25, 33] is for 36 layers). Narrow (``hidden``) and shallow, so that the CPU runs
    every stage on it: what is real is the vocabulary and the config keys every code path reads. The lm_head is tilted
    as in :func:`make_pair` so that acceptance varies. Saved as checkpoints the loader reads; returns the folders."""
    from pathlib import Path

    from dflash.model import build_target_layer_ids

    folder = Path(folder)
    torch.manual_seed(seed)
    heads = max(2, hidden // 32)
    common = dict(vocab_size=QWEN3_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-6)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=target_layers, tie_word_embeddings=False,
                                          eos_token_id=QWEN3_VOCAB - 2, **common)).eval()
    draft_cfg = Qwen3Config(num_hidden_layers=draft_layers, num_target_layers=target_layers, **common)
    draft_cfg.architectures = ["DFlashDraftModel"]
    draft_cfg.block_size = 16
    draft_cfg.dflash_config = {"mask_token_id": ZLAB_MASK_ID,
                               "target_layer_ids": build_target_layer_ids(target_layers, draft_layers)}
    draft = DFlashDraftModel(draft_cfg).eval()
    with torch.no_grad():
        w = target.lm_head.weight
        u = torch.randn(w.shape[1])
        w[3] += 0.3 * u / u.norm()
        w[4] -= 0.3 * u / u.norm()
    target.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    return folder / "target", folder / "draft"
