"""Seeds of sampled draws (T > 0): reproducible from decode.seed, and never one stream for every prompt."""

from __future__ import annotations

import hashlib


def draw_seed(seed: int, prompt_id: str, draw: int, purpose: str = "decode") -> int:
    """The seed of one sampled draw of one prompt: decode.seed, the prompt and the draw hashed together. What a
    prompt's draw decodes with shares it (every evaluated method, every labelled candidate: common random numbers,
    so they differ by the method more than by the draw), and no two prompts share a stream: with one seed for
    every prompt, the multinomial's uniforms repeat prompt after prompt, so the prompts' tokens are not independent
    draws, labels share their noise, and a distribution test over them is overdispersed (an exact AR sampler failed
    pipeline.evaluation.distribution's check at p < 0.001 on 36 prompts)."""
    digest = hashlib.blake2b(f"{int(seed)}/{prompt_id}/{int(draw)}/{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63: what torch.manual_seed takes
