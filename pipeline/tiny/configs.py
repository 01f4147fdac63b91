"""The tiny pair's model configs: a Qwen3 causal LM target and a DFlash draft sized from it."""

from __future__ import annotations

BLOCK_SIZE = 8  # the draft's trained block size


def make_target_config(vocab_size: int, eos_id: int, args):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.target_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def make_draft_config(tcfg, mask_id: int, layer_ids, args):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=tcfg.vocab_size,
        hidden_size=tcfg.hidden_size,
        intermediate_size=args.draft_intermediate,
        num_hidden_layers=args.draft_layers,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=tcfg.head_dim,
        max_position_embeddings=tcfg.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=tcfg.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=tcfg.eos_token_id,
        eos_token_id=tcfg.eos_token_id,
        pad_token_id=tcfg.pad_token_id,
        use_cache=True,
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = tcfg.num_hidden_layers
    cfg.block_size = BLOCK_SIZE
    cfg.dflash_config = {
        "block_size": BLOCK_SIZE,
        "mask_token_id": mask_id,
        "target_layer_ids": list(layer_ids),
    }
    return cfg
