import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# One intra-op thread per process: on 2 cores, torch's default (one per core) oversubscribes the CPU as soon as a Ray
# actor, a subprocess or another test process runs beside it, and tiny-model tests then take minutes instead of
# seconds. The pipeline's own workers set their threads explicitly.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train V2's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default) and each
# phase of a train run waits for a poll. The CLI sets 0.5 s for a local Ray of its own
# (pipeline/executor/ray/runtime.py); the session's Ray (ray_session below) and the train runs made on it in this
# process would get the 2 s default. A poll interval, not behaviour: it reaches the session's Ray, the CLI's
# subprocesses (where the CLI's setdefault keeps it) and, propagated by Ray Train, each run's controller.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# The session's Ray is local, one node, no autoscaler: as for the CLI's own local Ray
# (pipeline/executor/ray/runtime.py), Ray Train's preemption watcher has nothing to watch there, and its actor cost
# each train run ~2 CPU-s.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

REPO = Path(__file__).resolve().parent.parent
INTEGRATION = Path(__file__).resolve().parent / "integration"


# The slowest modules first (by their summed `--durations=0` times in the whole suite on this 2-core machine, the
# mean of two runs on 2026-12-05; test_gpu_check_cpu and test_compiled moved down on 2026-12-06, when the first's
# steps came to share one process and the second lost a target layer; a module's sum moves by up to 70 s with what
# the other worker runs beside it):
# `-n 2 --dist loadfile --no-loadscope-reorder` hands whole modules to the workers in this order, each worker taking
# the next when it finishes one, so that the last module to start is a short one (longest first keeps the two within
# about a module of each other). xdist's default order (--loadscope-reorder, on unless turned off in pyproject.toml's
# addopts) sorts modules by their number of tests instead: it started test_real_shapes (one test, 182 s) last, and
# one worker then ran alone for its last three minutes.
SLOWEST_FIRST = ["test_cluster", "test_faults", "test_vllm", "test_stages", "test_cli_run", "test_cluster_growth",
                 "test_object_storage", "test_store_faults", "test_real_shapes", "test_model_refusals",
                 "test_sampled_run", "test_gpu_check_cpu", "test_compiled", "test_broken_device",
                 "test_distribution_check", "test_simulate", "test_replay", "test_pool_failures",
                 "test_step_rule_sampling", "test_batched", "test_pool_timeouts", "test_pool_faults", "test_device_task",
                 "test_install",
                 "test_shared_profile", "test_validate", "test_rayjob", "test_expected_acceptance"]


def pytest_collection_modifyitems(items):
    """Two layers: tests/unit (no Ray, seconds each) and tests/integration (real Ray, clusters, faults, CPU compiles,
    and the statistical checks of sampling, each hundreds of decodes). A test in tests/unit marked ``integration``
    belongs to the second layer but sits beside the unit tests of its code: an exactness sweep over hundreds of
    decodes (the unit layer keeps the same check per variant, on a few steps) or a test that needs a fresh
    interpreter of its own (~4-8 s of imports each). The slowest modules first (SLOWEST_FIRST); within a module, its
    own order."""
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))  # stable: the rest as collected


# ---- the machine's speed beside the durations ------------------------------------------------------------------------
# This machine's speed moves by up to about 3x between days (benchmarks/machine_speed.py), and the suite's time with it:
# the session (xdist's controller, or a run without xdist) times the same fixed loop at its start and at its end and
# prints both after the durations, so that a suite time is never read without the machine's speed then.
_SPEED: dict = {}


def _machine_speed() -> float:
    """The median of three runs of benchmarks/machine_speed.py's loop (~0.1 s each): CPU seconds, lower is faster.
    Loaded from its file (benchmarks/ is not a package on sys.path), once a session."""
    import statistics

    if "module" not in _SPEED:
        import importlib.util

        spec = importlib.util.spec_from_file_location("machine_speed", REPO / "benchmarks" / "machine_speed.py")
        _SPEED["module"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_SPEED["module"])
    return statistics.median(_SPEED["module"].reference_loop() for _ in range(3))


def pytest_sessionstart(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _SPEED["start"] = _machine_speed()


def pytest_terminal_summary(terminalreporter):
    if "start" in _SPEED:
        terminalreporter.write_line(
            f"machine speed (benchmarks/machine_speed.py, CPU-s of a fixed loop, lower is faster): "
            f"{_SPEED['start']:.3f} at the start, {_machine_speed():.3f} at the end (the suite's time at known speeds: "
            f"that file's docstring)")


# One label source and two evaluation sets, the code kind's (the pre-#24 default): the small runs of the tests keep
# readable counts (16 prompts, 4 shards, 8 evaluation rows) whatever the default's mix of kinds; the mix itself is
# covered by tests/unit/test_prepare.py and the default run.
ONE_SOURCE = [
    "prepare.sources=[{name: stdlib-heldout, kind: bundled, path: stdlib-heldout, split: label}]",
    "evaluate.sources=[{name: humaneval, kind: bundled, path: humaneval}, "
    "{name: stdlib-heldout-eval, kind: bundled, path: stdlib-heldout, split: eval}]",
]
# Small, fast settings for the real tiny pair: what the stage tests share.
FAST = [
    *ONE_SOURCE,
    # The models on the CPU, always: the session's Ray and the test clusters advertise GPUs that do not exist
    # (logical GPUs: actors placed one per GPU as on a GPU node), and with model.device=auto a worker given a GPU
    # that torch cannot see is refused by the preflight, as it must be on a real cluster.
    "model.device=cpu",
    "progress=false", "decode.max_new_tokens=32", "prepare.shard_size=8", "prepare.limit=16",
    # The MLP (its epochs and checkpoints are what the train, resume and fault tests follow); the default ridge is
    # trained in test_stages.py::test_the_default_ridge_policy_*. The rule actions stay on (the default's).
    "workers.cpus_per_worker=0.5", "train.model=mlp", "train.epochs=4", "train.hidden=64", "train.lr=1e-3",
    "train.batch_size=8",
    "train.val_fraction=0.25", "train.use_gpu=false", "evaluate.limit=4",
    "train.checkpoint_every=2", "label.k=2",
    "tune.limit=4", "tune.rules=[threshold:0.05,ema:0.5:2,learned]",
    # One short round of the start-up cost profile: the default's 2 contexts x 3-5 rounds took 48-57 s of a 68 s
    # 16-prompt label run (labelling itself ~2 s). No test here asserts on measured costs. Two steps a point: a label
    # actor (16 prompts, alone on this machine, 2 runs a side) profiled in 2.05-2.17 s at 4 steps, 1.07-1.14 s at 2,
    # its whole process 9.7-11.3 -> 8.8-8.9 CPU-s; the suite starts ~35 such actors.
    "profile.context_lengths=[32]", "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1",
    # No load grid: the batch-1 profile alone, and evaluate at c = 1 alone. A label-only test has no reader of the
    # grid, which cost ~2 of each label actor's ~5 CPU-s of profile (c = 16 in lockstep); the tests of the passes at
    # load add LOAD below, or a grid of their own.
    "profile.concurrency=[1]", "evaluate.concurrency=[1]", "profile.load_rounds=1", "evaluate.load_repeats=2",
    # tune's load check on a few val prompts, twice: what it writes and who reads it, not its verdict's timing
    "tune.load_prompts=8", "tune.load_repeats=2", "tune.load_max_repeats=2",
    # One actor per decoding stage (the default's two each cost a second interpreter with its ~6 CPU-s of imports,
    # a model load and, in label, a cost profile, in every stage of every test on two shared cores). The tests of
    # several workers say so themselves: test_shared_profile (two label actors on distinct GPUs), test_cluster,
    # test_broken_device, test_faults.
    "label.num_workers=1", "evaluate.num_workers=1", "tune.num_workers=1",
]
# The load grid for the tests of what runs at load (evaluate's pass at load, tune's load check, deploy's schedule):
# c = 4 and 16 once (the default's finer grid adds start-up, not coverage), evaluate at c = 16 with FAST's two timed
# repeats. The stage tests check what is written, not the timings.
LOAD = ["profile.concurrency=[1,4,16]", "evaluate.concurrency=[1,16]"]


def _autograd_off() -> list:
    """What of torch's autograd state differs from a fresh process's, in words ([] when nothing)."""
    import torch

    return [what for what, on in (("inference mode on", torch.is_inference_mode_enabled()),
                                  ("autograd off", not torch.is_grad_enabled())) if on]


_TURNED_BACK: list = []  # the guards that turned back a state found at a test's start, alive for the process


@pytest.fixture(autouse=True)
def autograd_as_found():
    """Every test runs with autograd on and outside inference mode, as in a fresh process, and a test that leaves
    either changed fails, naming it. In the fresh-clone runs of c61daa9 and aae93cf (2026-12-06) five in-process
    training tests in one worker failed with "element 0 of tensors does not require grad": state left by a test
    before them in that worker, which no failure named (re-enabling grad mode alone did not help, aae93cf: inference
    mode has to be left too). The likely source, found later: vLLM's matmul handlers outliving the in-process engine
    and dying inside test_compiled's compile tracing (pipeline.decoding.vllm_engine.VllmEngine.shutdown), fixed
    there; inferred from one run's log, never reproduced on demand. So the bug class fails where it happens instead
    of being repaired under a warning: each test runs inside ``inference_mode(False)`` and ``enable_grad()``, its
    teardown fails it when either was left changed inside them (by the test or its function-scoped fixtures), and
    leaving them restores the state for the tests after it. A state already changed at a test's start was left
    outside any test (a wider-scoped fixture, code run at import): that test errors at setup, and the state is turned
    back for good, so that the tests after it run as in a fresh process. tests/unit/test_autograd_guard.py runs both
    cases."""
    import torch

    found = _autograd_off()
    if found:
        guard = torch.inference_mode(False)  # turns inference mode off and autograd on until the process ends
        guard.__enter__()
        _TURNED_BACK.append(guard)
        pytest.fail(f"{' and '.join(found)} at this test's start: left outside any test (a wider-scoped fixture or "
                    f"code run at import); turned back for the tests after this one", pytrace=False)
    with torch.inference_mode(False), torch.enable_grad():
        yield
        left = _autograd_off()
    if left:
        pytest.fail(f"this test left torch's {' and '.join(left)} (restored for the tests after it): a context "
                    f"entered and never exited, or a set_grad_enabled(False) never undone", pytrace=False)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny models gain nothing from more; on a busy 2-core box more spin)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ray_session(s3_server):
    """One local Ray for the whole session, advertising 2 GPUs that do not exist: label and evaluate then place
    one actor per (fake) GPU exactly as on a GPU node, while the models run on the CPU (CUDA is absent). Its workers
    get the session's S3 server's client environment, so that a stage in this process can write to a test's bucket
    from its actors and Ray Train workers as a fresh process's local Ray would: inherited, as there, from the
    environment the local Ray's processes start in (set for ``ray.init`` alone; this process's own stays clean). Not
    a job ``runtime_env``: with one, Ray starts every worker through its runtime-env setup, 1.20-1.25 against
    0.65-0.68 CPU-s of the machine per bare actor (benchmarks/results/ray-worker-start.md), and this Ray starts
    ~100."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env.items():
            mp.setenv(k, v)
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    # Its workers' logs go to no driver (log_to_driver=False), yet Ray's log monitor would tail every worker's log
    # files ten times a second for nobody, at a cost that grows with the files: 30 CPU-s by 1,040 s into the suite of
    # 2026-12-06, ~1.5 % of the machine's cores. Stopped; ray.shutdown stops the rest as usual.
    ray._private.worker._global_node.kill_log_monitor()
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def blockpilot(*args, timeout=600, **kw):
    """Run the CLI in a fresh process (its own local Ray: ray.address=local)."""
    return subprocess.run([sys.executable, "-m", "stages.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, **kw)


@pytest.fixture(scope="session")
def real_labels(tmp_path_factory):
    """A real label set without Ray: prepare + label of 8 bundled prompts (2 shards of 4) on the tiny pair, through
    the stage driver's in-process executor. Read-only: tests copy it before damaging it."""
    import torch

    from pipeline.runtime.config import load_config
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from stages.label import LabelStage
    from stages.prepare import PrepareStage

    out = tmp_path_factory.mktemp("real-labels")
    cfg = load_config([f"output_dir={out}", "progress=false", "decode.max_new_tokens=16", "prepare.shard_size=4",
                       "prepare.limit=8", "label.k=2", "profile.steps=2", "profile.min_repeats=1", *ONE_SOURCE,
                       "profile.max_repeats=1", "profile.context_lengths=[16]",
                       # the batch-1 profile alone (no reader of a load grid here; FAST's comment)
                       "profile.concurrency=[1]", "evaluate.concurrency=[1]"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny pair gains nothing from more; on a busy 2-core box more threads spin (10x)
    try:
        run_stage(PrepareStage(cfg), LocalExecutor())
        run_stage(LabelStage(cfg), LocalExecutor())
    finally:
        torch.set_num_threads(threads)
    labels = out / "labels"
    manifest = json.loads((labels / "manifest.json").read_text())
    assert [(f["file"], f["rows"], f["rejects"], f["input_rows"]) for f in manifest["files"]] == \
        [("part-00000.parquet", 4, 0, 4), ("part-00001.parquet", 4, 0, 4)]
    return labels


# ---- a real S3-compatible server on 127.0.0.1 (moto in server mode), for object-storage tests -----------------------

class S3Server:
    """moto's S3 server in a subprocess of its own session, on a free port; ``env`` is what a client needs
    (endpoint and dummy credentials: moto accepts any)."""

    def __init__(self):
        import socket
        import time
        import urllib.request

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto S3 server did not start")
                time.sleep(0.2)

    def bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        self.proc.kill()  # by pid: it is ours alone
        self.proc.wait(10)


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request):
    """A fresh bucket on the session's server, with the client environment set for this process (and inherited by
    the subprocesses and Ray workers a test starts). Returns its ``s3://`` URI."""
    import re
    import uuid

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]
    return s3_server.bucket(name)


# ---- the fault matrix (benchmarks/fault_matrix.py runs `pytest -m faults` and prints these rows) --------------------

FAULT_MATRIX_ENV = "BLOCKPILOT_FAULT_MATRIX"


def fault_cost(summary) -> str:
    """A fault matrix row's cost from a stage's summary: its ``faults`` as the closing line says them, the prompts
    rejected, and the stage's seconds."""
    from pipeline.executor.driver import fault_line

    said = fault_line(summary["faults"])[len("faults cost: "):].rsplit("; ", 1)[0] if summary.get("faults") else ""
    return "; ".join(x for x in (said, f"{summary.get('rejects', 0)} prompt(s) rejected",
                                 f"{summary.get('wall_seconds', 0):.0f} s") if x)


@pytest.fixture
def fault_row(request):
    """``fault_row(fault, stage, expected, rows)``: one row of the fault matrix, from the rows a fault test found
    after its fault and rerun (ids, duplicates included) against the rows it expected. The test asserts the same
    counts itself; this only records them (to $BLOCKPILOT_FAULT_MATRIX, when set) for the matrix's table."""
    def record(fault: str, stage: str, expected, rows, cost: str = "") -> None:
        """``cost``: what the fault cost besides rows (prompts rejected, workers restarted or retired, seconds)."""
        rows = list(rows)
        path = os.environ.get(FAULT_MATRIX_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"test": request.node.nodeid, "fault": fault, "stage": stage,
                                     "expected": len(set(expected)), "found": len(set(rows)),
                                     "lost": len(set(expected) - set(rows)),
                                     "duplicates": len(rows) - len(set(rows)), "cost": cost}) + "\n")
    return record


@pytest.fixture(scope="module")
def batched():
    """(models, BatchedEngine) of the bundled tiny pair on the CPU in fp32, torch on one thread."""
    import torch

    from pipeline.decoding.batched import BatchedEngine
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config(["model.device=cpu", "model.dtype=float32"]).model)
    return m, BatchedEngine(Engine(m.target, m.draft, m.stop_token_ids))
