"""jobs/rayjob.yaml, the KubeRay example: a RayJob with the keys KubeRay documents, whose values do what the README
says (four one-GPU label pods, its clean-up, the code and output in one bucket), and whose entrypoint is what
`blockpilot submit --dry-run` prints for the same stage, config and overrides (no cluster, no Kubernetes).

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
STAGE, CONFIG = "label", "published:qwen3-8b"


@pytest.fixture(scope="module")
def job():
    (doc,) = list(yaml.safe_load_all(RAYJOB.read_text()))
    return doc


def gpus(container):
    resources = container["resources"]
    return {k: int(resources[k].get("nvidia.com/gpu", 0)) for k in ("requests", "limits")}


def test_the_rayjob_runs_the_label_actors_on_four_gpus_and_cleans_up_as_documented(job):
    """The values that decide what the job does, against what the README and the published config say: four
    one-GPU worker pods (README), one label actor per GPU (the published config's label.num_workers is null) with
    its workers.cpus_per_worker CPUs beside, no GPU on the head, a fixed-size cluster, the same image and Secret on
    every pod, a Ray version the package accepts, the cluster deleted 10 minutes after the job and a hung job
    stopped after 6 h (README), and the code and the output in the one bucket the Secret's credentials reach."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    from pipeline.runtime.config import load_config

    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert SPEC_KEYS <= set(spec) and spec["submissionMode"] == "K8sJobMode"  # the job's log in the submitter pod
    # Clean-up: ttlSecondsAfterFinished acts only with shutdownAfterJobFinishes.
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 10 * 60  # README's
    assert spec["activeDeadlineSeconds"] == 6 * 3600  # README: "stops a hung job after 6 h"
    # Resources: the head plans and writes manifests, every GPU is a worker pod's.
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert all(gpus(c) == {"requests": 0, "limits": 0} for c in head["template"]["spec"]["containers"])
    cfg = load_config([], CONFIG)
    assert cfg.label.num_workers is None  # one label actor per GPU the cluster has
    total = 0
    for group in cluster["workerGroupSpecs"]:
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]  # no autoscaling mid-label
        (container,) = group["template"]["spec"]["containers"]
        g = gpus(container)
        assert g["requests"] == g["limits"] >= 1  # Kubernetes takes extended resources only with requests == limits
        assert float(container["resources"]["requests"]["cpu"]) >= g["limits"] * cfg.workers.cpus_per_worker
        assert group["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        total += group["replicas"] * g["limits"]
    assert total == 4  # README: four one-GPU worker pods
    # Every pod: the same image (one Ray version across the cluster) and the same Secret (the driver on the head
    # writes manifests, the workers write shards).
    pods = [head, *cluster["workerGroupSpecs"]]
    containers = [c for p in pods for c in p["template"]["spec"]["containers"]]
    assert len({c["image"] for c in containers}) == 1
    assert all(c.get("envFrom") == [{"secretRef": {"name": "blockpilot-s3"}}] for c in containers)
    ray_req = next(Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "dependencies"] if Requirement(r).name == "ray")
    assert Version(cluster["rayVersion"]) in ray_req.specifier, (cluster["rayVersion"], str(ray_req))
    # The code travels as a zip in the bucket the output goes to.
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])  # a YAML document inside a string
    output = next(w for w in shlex.split(spec["entrypoint"]) if w.startswith("output_dir="))
    bucket = output.split("=", 1)[1].split("/")[2]
    assert runtime_env["working_dir"].startswith(f"s3://{bucket}/") and runtime_env["working_dir"].endswith(".zip")


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
