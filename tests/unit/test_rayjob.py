"""jobs/rayjob.yaml, the KubeRay example: it parses as a RayJob with the keys KubeRay documents, and its entrypoint
is what `blockpilot submit --dry-run` prints for the same stage, config and overrides (no cluster, no Kubernetes).

The keys, as KubeRay's RayJob API (ray.io/v1) spells them: ray-project/kuberay
ray-operator/config/samples/ray-job.sample.yaml and docs.ray.io's RayJob quickstart.
"""

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from stages.cli import main

REPO = Path(__file__).resolve().parents[2]
RAYJOB = REPO / "jobs" / "rayjob.yaml"
SPEC_KEYS = {"entrypoint", "runtimeEnvYAML", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
             "activeDeadlineSeconds", "submissionMode", "rayClusterSpec"}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode"}
STAGE, CONFIG = "label", "published:qwen3-8b"


@pytest.fixture(scope="module")
def job():
    (doc,) = list(yaml.safe_load_all(RAYJOB.read_text()))
    return doc


def test_the_rayjob_parses_with_the_keys_kuberay_documents(job):
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert SPEC_KEYS <= set(spec)
    assert spec["submissionMode"] in SUBMISSION_MODES
    assert spec["shutdownAfterJobFinishes"] is True  # ttlSecondsAfterFinished only acts with it
    for key in ("ttlSecondsAfterFinished", "activeDeadlineSeconds"):
        assert isinstance(spec[key], int) and spec[key] > 0
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])  # a YAML document inside a string
    assert isinstance(runtime_env, dict) and runtime_env["working_dir"].endswith(".zip")
    workers = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers and all(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1
                           for w in workers)  # the label actors run on GPU nodes


@pytest.mark.skipif(shutil.which("git") is None, reason="submit's upload rule reads the checkout with git")
def test_the_entrypoint_is_what_submit_dry_run_prints(job, capsys):
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:4] == ["python", f"jobs/{STAGE}.py", "-c", CONFIG]
    overrides = words[4:]
    assert any(o.startswith("output_dir=s3://") for o in overrides)  # storage every node reaches
    # The same stage, config and overrides through submit: validated here, and the command it would run printed.
    assert main(["submit", STAGE, "-c", CONFIG, *overrides, "--working-dir", str(REPO), "--dry-run"]) == 0
    printed = re.search(r"^blockpilot submit: entrypoint: (.*)$", capsys.readouterr().err, re.M)
    assert printed and printed.group(1) == job["spec"]["entrypoint"]
