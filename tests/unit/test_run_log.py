"""A clean default log (issue #26, item 4): none of Ray's internal lines and no raw dict or JSON dump by default;
``-v`` lets Ray's lines through. Ray-free: what ``ray.init`` is given (pipeline.executor.ray.executor.ray_init_plan), the
environment the CLI's log setup leaves for Ray's processes, and the lines the stages format themselves, checked
against the patterns of the Ray lines a default run printed before (copied below from such a run's log).
"""

import json
import logging
import os
import re

import pytest

from pipeline.evaluation.table import format_rows
from pipeline.runtime import log as bp_log
from pipeline.runtime.config import RayConfig, load_config
from pipeline.executor.ray.actor import worker_line
from pipeline.executor.ray.runtime import ray_init_plan
from stages.run import done_line

# Lines Ray printed into a default run (2026-12-01, 674 s) and the patterns that must match none of ours.
RAY_LINES = [
    "[2026-12-01 13:47:18,258 E 23313 23340] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and ID: "
    "'c7de592be43d4151bdd0827501000000' has constructor arguments in the object store and max_restarts > 0.",
    "(raylet) WARNING: 8 PYTHON worker processes have been started on node: 3ffdd02c with address: 10.0.150.21.",
    "Progress bars disabled. To enable, set `ray.data.DataContext.get_current().enable_progress_bars = True`.",
]
RAY_PATTERNS = [re.compile(p) for p in (r"core_worker\.cc", r"PreemptionWatcher", r"^\(raylet\)",
                                        r"PYTHON worker processes", r"^Progress bars disabled", r"DataContext")]
DICT_REPR = re.compile(r"\{['\"]?\w+['\"]?: ")  # {4: 19, ...} or {"rounds": 5, ...}


def problems(lines):
    """The lines of a log that are Ray's internals or a raw dict / JSON dump."""
    return [ln for ln in lines if ln.lstrip().startswith(("{", "[{")) or DICT_REPR.search(ln)
            or any(p.search(ln) for p in RAY_PATTERNS)]


def test_the_check_catches_the_lines_a_default_run_printed():
    assert problems(RAY_LINES) == RAY_LINES
    dumped = ['{', '  "stage": "run",', "[label] label histogram {4: 19, 5: 18}; mean tau {4: 2.9481}",
              '[label] worker n/cpu-1 pid=7 step_cost_seconds={"4": 0.007137}']
    assert problems(dumped) == [dumped[0], dumped[2], dumped[3]]  # '  "stage"' alone is no dump's first line


# ---- what ray.init gets --------------------------------------------------------------------------------------

def ray_would(kwargs, env):
    """What Ray itself makes of a plan, read through Ray's own code (no Ray started): whether ray.init takes every
    argument, whether its log level lets INFO / WARNING through, and whether Ray Train's controller would start its
    preemption watcher under that environment (it reads the flag with ray_constants.env_bool)."""
    import inspect

    import ray
    from ray._private import ray_constants
    from ray.train.v2._internal.constants import DEFAULT_ENABLE_PREEMPTION_WATCHER, ENABLE_PREEMPTION_WATCHER_ENV_VAR

    params = inspect.signature(ray.init).parameters
    unknown = [k for k in kwargs if k not in params]
    ray_logger = logging.Logger("ray-plan")
    ray_logger.setLevel(kwargs["logging_level"])
    saved = dict(os.environ)
    try:
        os.environ.pop(ENABLE_PREEMPTION_WATCHER_ENV_VAR, None)
        os.environ.update(env)
        watcher = ray_constants.env_bool(ENABLE_PREEMPTION_WATCHER_ENV_VAR, DEFAULT_ENABLE_PREEMPTION_WATCHER)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"unknown_args": unknown, "info": ray_logger.isEnabledFor(logging.INFO),
            "warning": ray_logger.isEnabledFor(logging.WARNING), "preemption_watcher": watcher,
            "starts_local": kwargs.get("address") in (None, "local"),
            "resources": {k: kwargs[k] for k in ("num_cpus", "num_gpus", "resources") if kwargs.get(k) is not None}}


@pytest.mark.parametrize("address", [None, "local"])
def test_a_local_ray_has_no_preemption_watcher_and_quiet_ray_logs(address):
    kwargs, env = ray_init_plan(RayConfig(address=address, num_cpus=3), verbosity=0, environ={})
    ray = ray_would(kwargs, env)
    assert ray["unknown_args"] == []  # ray.init takes every argument of the plan
    assert ray["preemption_watcher"] is False  # its actor's creation logged a core_worker.cc line
    assert ray["starts_local"] and ray["resources"] == {"num_cpus": 3}  # a new Ray of the config's size
    assert not ray["info"] and ray["warning"]  # Ray's INFO lines off, its warnings on
    assert kwargs["log_to_driver"] is True  # the actors' own lines (and tracebacks) still reach the terminal
    from ray.train.v2._internal.constants import HEALTH_CHECK_INTERVAL_S_ENV_VAR  # the name Ray Train reads

    assert float(env[HEALTH_CHECK_INTERVAL_S_ENV_VAR]) < 2.0  # its controller polls faster than its 2 s default


def test_a_cluster_keeps_its_preemption_watcher_and_verbose_lets_ray_info_through():
    kwargs, env = ray_init_plan(RayConfig(address="ray://head:10001", num_cpus=3), verbosity=1, environ={})
    ray = ray_would(kwargs, env)
    assert ray["unknown_args"] == [] and ray["preemption_watcher"] is True  # a cluster's nodes can be drained
    # Joining: the cluster's address, and no resources (ray.init refuses num_cpus / num_gpus for an existing one).
    assert not ray["starts_local"] and kwargs["address"] == "ray://head:10001" and ray["resources"] == {}
    assert ray["info"]  # -v
    assert "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in env  # a cluster's own setting stands
    kwargs, env = ray_init_plan(RayConfig(num_gpus=2), verbosity=0, environ={"RAY_ADDRESS": "10.0.0.1:6379"})
    ray = ray_would(kwargs, env)  # `ray job submit` sets RAY_ADDRESS: the job joins that cluster
    assert kwargs["address"] == "10.0.0.1:6379" and ray["resources"] == {} and ray["preemption_watcher"] is True


@pytest.fixture
def clean_log(monkeypatch):
    """setup() writes os.environ and the blockpilot logger: undo both."""
    for k in ("RAY_DATA_LOG_LEVEL", bp_log.ENV, "PYTHONWARNINGS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(k, raising=False)
    logger = logging.getLogger(bp_log.ROOT)
    handlers, level = list(logger.handlers), logger.level
    levels = {n: logging.getLogger(n).level for n in ("ray", "ray.data", "ray.train", "ray.tune")}
    yield
    logger.handlers[:], logger.level = handlers, level
    for n, lv in levels.items():
        logging.getLogger(n).setLevel(lv)


def test_default_verbosity_quiets_ray_data_notes_and_verbose_does_not(clean_log):
    bp_log.setup(0)
    assert os.environ["RAY_DATA_LOG_LEVEL"] == "ERROR"  # the "Progress bars disabled" note is a warning
    assert logging.getLogger("ray.data").level == logging.ERROR
    os.environ.pop("RAY_DATA_LOG_LEVEL")
    bp_log.setup(1)
    assert "RAY_DATA_LOG_LEVEL" not in os.environ  # -v: Ray Data's own level, its notes print


def test_a_users_ray_data_level_wins(clean_log, monkeypatch):
    monkeypatch.setenv("RAY_DATA_LOG_LEVEL", "INFO")
    bp_log.setup(0)
    assert os.environ["RAY_DATA_LOG_LEVEL"] == "INFO"


# ---- the lines the stages print --------------------------------------------------------------------------------

def test_worker_lines_are_short_and_hold_no_dict():
    info = {"identity": "130a9b7a80a2/cpu-df3198d1", "pid": 23075, "node_id": "130a9b7a80a2" * 4, "gpu_ids": [],
            "device": "cpu/float32", "step_ms": "7.137..8.133 at b=4..12 (profiled in 52.1 s, 5 rounds)",
            "step_cost_seconds": {4: 0.007137, 12: 0.008133},
            "cost_profile": {"rounds": 5, "stable": False, "fit": {"draft": {"intercept": 0.0022}}}}
    line = worker_line(info)
    assert line == ("worker 130a9b7a80a2/cpu-df3198d1 pid=23075 device=cpu/float32 "
                    "step_ms=7.137..8.133 at b=4..12 (profiled in 52.1 s, 5 rounds)")
    assert problems([line]) == []


def test_the_label_summary_line_is_not_a_dicts_repr(tmp_path):
    from stages.label import LabelStage

    stage = LabelStage(load_config([f"output_dir={tmp_path}"]))
    lines = stage.summary_lines({"rows": 3, "label_histogram": {4: 1, 8: 2}, "mean_tau": {4: 2.9481, 8: 4.3461}})
    assert lines == ["label histogram (b:rows) 4:1 8:2; mean tau (b:tau) 4:2.95 8:4.35"]
    assert problems(lines) == []


def test_the_runs_closing_lines():
    line = done_line(674.0, {"prepare": 2.21, "label": 213.94, "report": 1.5})
    assert line == "done in 674.0 s (prepare 2.2 s, label 213.9 s, report 1.5 s)"
    rows = [{"row": "adaptive (policy + rule)", "method": "adaptive", "modelled": 1.821, "wall": 1.621,
             "gain": 0.006, "gain_ci95": [-0.001, 0.0151], "gain_on": "modelled", "baseline_b": 9},
            {"row": "train-chosen b=9", "method": "b=9", "modelled": 1.81, "wall": 1.534, "gain": 0.0,
             "gain_ci95": None, "gain_on": "modelled", "baseline_b": 9}]
    table = format_rows(rows).splitlines()
    assert len(table) == 3 and problems([line, *table]) == []


# ---- how many lines the stages print (the default run's log is at most 60 lines) ---------------------------------

def test_progress_prints_no_line_for_the_last_shard_but_always_one_for_a_failure(caplog):
    from pipeline.executor.progress import Progress

    caplog.set_level(logging.INFO, logger="blockpilot")
    p = Progress("label", total=3, every=3600.0)
    p._last -= 3601.0  # the first update comes after `every`: one line
    for extra in ("a", "b", "c"):  # then nothing until `every` again, and nothing at the end: the done line says it
        p.update(1, extra)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["1/3 prompts"]
    p.update(0, "part-00002.parquet failed", force=True)
    assert caplog.records[-1].getMessage().endswith("part-00002.parquet failed")


def test_a_source_is_one_line_shown_when_it_says_more_than_the_closing_count():
    """Each source's line goes to the log where it tells what prepare's closing "prompts per source" line does not
    (rejects, an empty file, a slow read), to -v otherwise: a clean source read in a blink is only that count."""
    from pipeline.data.sources import build_prompts
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import ModelConfig, SourceConfig

    shown, debug = [], []
    cfg = load_config()
    tok = load_models(ModelConfig(device="cpu", dtype="float32")).tokenizer
    build_prompts(cfg.evaluate.sources, tok, cfg.prepare.max_prompt_tokens, limit=2, log=shown.append,
                  debug=debug.append)
    assert shown == [] and len(debug) == len(cfg.evaluate.sources) >= 2, (shown, debug)
    for src, line in zip(cfg.evaluate.sources, debug):
        assert line.startswith(f"source {src.name!r} ({src.kind} {src.path}, limit 2): ") and \
            "2 accepted" in line, line

    code = [SourceConfig(name="code", kind="bundled", path="code")]
    shown, debug = [], []  # rows over max_prompt_tokens: too_long rejects
    build_prompts(code, tok, 4, limit=2, log=shown.append, debug=debug.append, require_any=False)
    assert debug == [] and len(shown) == 1 and shown[0].startswith("source 'code'") and "too_long" in shown[0], shown


# ---- how a stage command ends (issue #36): its done: line and a short summary; JSON only with --json -------------

# Small real runs of the Ray-free stage commands (the bundled tiny pair and prompts); label, train, tune, evaluate and
# report end the same way through the same code (tests/integration/test_stages.py::test_each_stage_ends_with_*).
PREPARE = ["prepare.limit=2", "prepare.sources=[{name: code, kind: bundled, path: code}, "
           "{name: docs, kind: bundled, path: docs}]"]
PROFILE = ["profile.context_lengths=[16]", "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1",
           "profile.max_block_size=3", "profile.concurrency=[1]", "evaluate.concurrency=[1]"]


def closing(lines, stage):
    """The stage's lines from its done: line on."""
    done = [i for i, ln in enumerate(lines) if ln.startswith(f"[{stage}] done: ")]
    assert done, lines
    return lines[done[-1]:]


def cli(capsys, *args):
    from stages.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, out + err
    return out.splitlines(), err.splitlines()


@pytest.mark.parametrize("stage, extra", [("prepare", PREPARE), ("profile", PROFILE)])
def test_a_stage_command_ends_with_its_done_line_and_a_short_summary(clean_log, capsys, tmp_path, stage, extra):
    out, err = cli(capsys, stage, f"output_dir={tmp_path}", *extra)
    tail = closing(out, stage)
    assert out[-len(tail):] == tail and 2 <= len(tail) <= 3, out  # the done line and one or two summary lines
    assert problems(out) == [] and not any(ln.startswith("{") for ln in out), out  # no JSON, no dict
    assert all(ln.startswith(f"[{stage}] ") for ln in out) and len(out) <= 12, out
    saved = json.loads((tmp_path / ("prompts/summary.json" if stage == "prepare" else "cost_profile.json"))
                       .read_text())
    if stage == "prepare":  # the summary line says what summary.json holds
        assert tail[0].endswith(f"-> {tmp_path / 'prompts'}") and f"done: {saved['rows']} rows" in tail[0]
        cut = saved["sharding"]  # 4 prompts for the default's 2 label workers: shards of 8 at least
        assert (cut["shard_size"], cut["label_workers"]) == (8, 2), cut
        assert tail[1] == (f"[prepare] prompts per source code:2 docs:2; {saved['duplicates']} duplicates dropped; "
                           "shards of 8 for 2 label worker(s) (prepare.shards_per_worker=4)")
    else:
        assert tail[0].endswith(f"-> {tmp_path / 'cost_profile.json'}") and \
            f"done: {saved['rounds']} rounds in {saved['wall_seconds']} s" in tail[0]
    # -q: the closing lines alone (of a fresh run: the same lines, but for what it measured).
    out_q, _ = cli(capsys, stage, "-q", f"output_dir={tmp_path / 'q'}", *extra)
    assert closing(out_q, stage) == out_q and len(out_q) == len(tail), (out_q, tail)


def test_json_only_on_request_and_then_alone_on_stdout(clean_log, capsys, tmp_path):
    out, err = cli(capsys, "prepare", f"output_dir={tmp_path}", *PREPARE, "--json")
    summary = json.loads("\n".join(out))  # stdout is the JSON and nothing else
    assert summary == json.loads((tmp_path / "prompts" / "summary.json").read_text())
    assert summary["rows"] == 4 and summary["sources"] == {"code": 2, "docs": 2}
    assert closing(err, "prepare")[0].startswith("[prepare] done: 4 rows")  # the log went to stderr
    # A rerun is skipped, and says so on its closing line; without --json, no JSON.
    out, err = cli(capsys, "prepare", f"output_dir={tmp_path}", *PREPARE)
    assert out[-1] == f"[prepare] done: skipped, {tmp_path / 'prompts'} is complete (4 rows)" and err == []
    assert problems(out) == []


def test_every_stage_command_takes_json():
    from stages import STAGES
    from stages.cli import build_parser

    parser = build_parser()
    for name in STAGES:
        assert parser.parse_args([name, "--json"]).json is True, name
        assert parser.parse_args([name]).json is False, name


def test_within_one_run_a_later_stage_says_only_what_changed():
    """pipeline.runtime.log.said_before: inside one_run() (what `blockpilot run` wraps its stages in), a topic said
    again unchanged is reported as said (the later stage prints "as the previous stage's"); a change, or any stage
    run alone, says it in full."""
    workers = ("2 actor(s) of CPU 1, models on cpu", "no GPU in the cluster", "every worker cpu, float32")
    assert not bp_log.said_before("workers", workers)  # a stage run alone: always in full
    assert not bp_log.said_before("workers", workers)
    with bp_log.one_run():
        assert not bp_log.said_before("workers", workers)  # label: the first time
        assert bp_log.said_before("workers", workers)  # tune: the same workers
        assert not bp_log.said_before("workers", (*workers[:2], "every worker cpu, bfloat16"))  # evaluate: changed
        assert not bp_log.said_before("placement", workers)  # another topic
    with bp_log.one_run():  # the next run starts afresh
        assert not bp_log.said_before("workers", workers)
    assert not bp_log.said_before("workers", workers)
