"""Which SDPA kernels accept each attention call the engines make, on this device (issue #45, point 2).

For every call shape (batch-1 verify: causal, no mask; one-token greedy decode of a batch: a padding mask; the
batched engine's ragged rows: a mask per row, as pipeline.decoding.packed.attend calls it), with the key/value
heads broadcast (``enable_gqa``) and repeated, each backend is tried alone under ``torch.nn.attention.sdpa_kernel``;
a backend that cannot take the call raises, and is reported as refused. Qwen3-8B's heads (32 query, 8 key/value,
head_dim 128) at a 1k context; on CPU the same heads in fp32. ``--context`` and ``--rows`` shrink the calls for the
CPU dry run of benchmarks/gpu_check.sh (which kernel takes a call depends on its layout, mask and dtype, not on its
length: on this 2-core CPU the default sizes took 7.4 s and 11 CPU-s, ``--context 128 --rows 8`` 1.7 s and 1.9, each
call taken by the same kernels).

    python benchmarks/sdpa_kernels.py [--device cuda] [--dtype bfloat16] [--context 1024] [--rows 64]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def accepted(q, k, v, mask, causal, gqa):
    out = []
    for name, backend in BACKENDS.items():
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                 enable_gqa=gqa)
            out.append(name)
        except RuntimeError:
            pass
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--context", type=int, default=1024, help="keys per row (default 1024)")
    ap.add_argument("--rows", type=int, default=64, help="the greedy decode's rows; the ragged step has a quarter")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    H, KV, D, ctx, rows = 32, 8, 128, a.context, a.rows
    calls = {"batch-1 verify (16 tokens, causal)": (1, 16, None, True),
             f"greedy decode ({rows} rows, 1 token, padding mask)": (rows, 1, "pad", False),
             f"ragged batched step ({max(1, rows // 4)} rows, 8 tokens, row masks)": (max(1, rows // 4), 8, "rows",
                                                                                      False)}
    print(f"device {a.device}, {dtype}, torch {torch.__version__}; heads {H}/{KV}, head_dim {D}, context {ctx}")
    for name, (rows, qn, mask_kind, causal) in calls.items():
        q = torch.randn(rows, H, qn, D, device=a.device, dtype=dtype)
        k = torch.randn(rows, KV, ctx, D, device=a.device, dtype=dtype)
        v = torch.randn_like(k)
        mask = None
        if mask_kind:
            mask = torch.ones(rows, 1, qn, ctx, dtype=torch.bool, device=a.device)
            mask[:, :, :, :7] = False  # left padding / another row's keys
        if causal:
            k, v = k[:, :, :qn], v[:, :, :qn]
        broadcast = accepted(q, k, v, mask, causal, True)
        repeated = accepted(q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1), mask, causal, False)
        print(f"  {name:<52} enable_gqa: {', '.join(broadcast) or 'none'}; heads repeated: "
              f"{', '.join(repeated) or 'none'}")


if __name__ == "__main__":
    main()
