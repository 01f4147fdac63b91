"""The packed attention (pipeline.decoding.packed.attend): key/value heads broadcast (CPU) and repeated (CUDA with
a mask, so that the memory-efficient kernel can run) give the same output; and on this CPU every call shape the
engines make runs on the CPU flash kernel, not only the math one (benchmarks/sdpa_kernels.py)."""

import importlib.util
from pathlib import Path

import torch

from pipeline.decoding.packed import attend


def test_broadcast_and_repeated_heads_agree_with_a_row_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 5, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    mask = torch.rand(3, 1, 5, 40) > 0.3
    mask[..., 0] = True  # every query sees a key
    a = attend(q, k, v, mask, 0.25, broadcast_gqa=True)
    b = attend(q, k, v, mask, 0.25, broadcast_gqa=False)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert attend(q, k, v, mask, 0.25).shape == (3, 8, 5, 16)  # CPU default: broadcast


def test_every_engine_call_runs_on_a_fused_kernel_on_this_cpu(capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sdpa_kernels.py"
    spec = importlib.util.spec_from_file_location("sdpa_kernels", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    probe.main(["--device", "cpu"])
    lines = [l for l in capsys.readouterr().out.splitlines() if "enable_gqa:" in l]
    assert len(lines) == 3
    for line in lines:
        broadcast = line.split("enable_gqa:")[1].split(";")[0]
        assert "flash" in broadcast, line
