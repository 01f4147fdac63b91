"""benchmarks/gpu_check.sh's CPU dry run: every step of the script a lent GPU runs (engine exactness, replay
agreement, the pipeline on the device, the labelling benchmark, the SDPA kernel probe, the 8B-shaped step costs
eager and compiled) runs here at tiny sizes and its summary reads what the steps wrote, so that the script cannot
rot between GPU sessions (its summary block once did, unnoticed). The figures mean nothing on CPU."""

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu-check"
    env = {**os.environ, "PYTHON": str(REPO / ".venv" / "bin" / "python")} \
        if (REPO / ".venv" / "bin" / "python").exists() else dict(os.environ)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--device", "cpu", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    summary = proc.stdout[proc.stdout.index("gpu_check summary"):] if "gpu_check summary" in proc.stdout else ""
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    status = (out / "status.txt").read_text().split("\n")
    steps = [line.split()[0] for line in status if line.strip()]
    assert steps == ["engine-fp32", "engine-bf16", "replay-bf16", "pipeline", "throughput", "sdpa-kernels",
                     "costs-8b"], status
    assert "Traceback" not in summary, summary
    for needle in ("engine float32", "pipeline (wall): adaptive", "enable_gqa:", "8B shapes batch-1 step",
                   "throughput: ratio batched/naive"):
        assert needle in summary, (needle, summary)
    costs = json.loads((out / "costs-8b.json").read_text())
    compiled = costs["compiled"]  # engine.compile=on beside eager, as a lent GPU runs it
    assert compiled["compile_s"] > 0 and all(v > 0 for v in compiled["step_s"].values())
    assert all(v > 0 for v in compiled["decode_step_s"].values())
