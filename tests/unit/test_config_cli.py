"""Config schema and CLI: merge order, fail-fast errors naming the key, resolved config written per stage."""

import pytest

from stages.cli import main
from pipeline.runtime.config import REPO_ROOT, ConfigError, config_sha256, load_config, write_resolved


def test_merge_order_schema_default_file_overrides(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("decode:\n  max_new_tokens: 64\nlabel:\n  k: 1\n")
    cfg = load_config(["label.k=3", "output_dir=/tmp/somewhere"], str(f))
    assert cfg.decode.max_new_tokens == 64  # file over default.yaml (128)
    assert cfg.label.k == 3  # override over file
    assert cfg.output_dir == "/tmp/somewhere"
    assert cfg.prepare.shard_size == 64  # conf/default.yaml (the schema's default equals it: test_conf_defaults.py)
    assert cfg.train.lr == 1e-5  # neither file nor override sets it


@pytest.mark.parametrize("override,key", [
    (["no_such_key=1"], "no_such_key"),
    (["label.nope=1"], "label.nope"),
    (["decode.max_new_tokens=abc"], "decode.max_new_tokens"),
    (["train.epochs=1.5"], "train.epochs"),
    (["label.mode=sometimes"], "label.mode"),
    (["decode.top_p=0"], "decode.top_p"),
    (["decode.temperature=0.7", "label.mode=replay"], "label.mode"),
    (["prepare.sources=[{name: x, path: y}]"], "prepare.sources[0].kind"),
    (["prepare.sources=[{name: x, kind: csv, path: y}]"], "prepare.sources[0].kind"),
    (["workers.task_timeout_s=0"], "workers.task_timeout_s"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(override)
    assert f"'{key}'" in str(err.value)


def test_missing_config_file_and_malformed_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config([], "/no/such/file.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["justakey"])


def test_resolved_config_and_digest(tmp_path):
    cfg = load_config([f"output_dir={tmp_path}"])
    digest = write_resolved(cfg, tmp_path / "label")
    assert (tmp_path / "label" / "config.sha256").read_text().strip() == digest == config_sha256(cfg)
    again = load_config([], str(tmp_path / "label" / "config.yaml"))
    assert config_sha256(again) == digest  # the written YAML reloads to the same config
    assert config_sha256(load_config(["label.k=1"])) != digest


def test_cli_fails_fast_naming_the_key(capsys):
    assert main(["label", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def help_text(capsys, *argv: str) -> str:
    """``blockpilot ARGV --help``'s output, in-process (argparse prints it and exits 0)."""
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_cli_help_lists_every_stage(capsys):
    out = help_text(capsys)
    for stage in ("prepare", "label", "train", "evaluate", "report", "run", "validate"):
        assert f"    {stage}" in out
    stage_help = help_text(capsys, "label")
    assert "max_new_tokens: 128" in stage_help and "mode: auto" in stage_help


def _sections_read(module: str, seen=None) -> set:
    """Config sections a stage module reads (``cfg.SECTION`` / ``self.cfg.SECTION``), with the stage modules it
    imports (``from .X import``), read from their source."""
    import re

    seen = set() if seen is None else seen
    # (The Ray executor, pipeline/executor/ray/, reads `ray` for the actor pool only, which runs only stages that
    # declare actors, and list `ray`; relative imports alone are followed, so it is not.)
    if module in seen:
        return set()
    seen.add(module)
    src = (REPO_ROOT / "stages" / f"{module}.py").read_text()
    found = set(re.findall(r"\bcfg\.([a-z_]+)\b", src))
    for dep in re.findall(r"^from \.(\w+) import", src, re.M):
        found |= _sections_read(dep, seen)
    return found


@pytest.mark.parametrize("stage", ["prepare", "label", "train", "evaluate", "report"])
def test_stage_help_lists_every_key_the_stage_reads(stage, capsys):
    from omegaconf import OmegaConf

    from pipeline.runtime.config import PipelineConfig
    from stages import STAGES

    sections = {k for k, v in OmegaConf.structured(PipelineConfig).items() if OmegaConf.is_dict(v)}
    read = _sections_read(stage) & sections
    assert read <= set(STAGES[stage].sections), f"{stage} reads {sorted(read - set(STAGES[stage].sections))}"
    shown = help_text(capsys, stage)
    for section in read:
        for key in OmegaConf.structured(PipelineConfig)[section]:
            assert f"  {key}:" in shown, (stage, section, key)
    assert "output_dir:" in shown and "force:" in shown


def test_evaluate_help_lists_the_prepare_keys_its_prompts_depend_on(capsys):
    out = help_text(capsys, "evaluate")
    for key in ("max_prompt_tokens:", "apply_chat_template:", "shard_size:", "num_workers:", "cpus_per_worker:"):
        assert key in out, key


@pytest.mark.parametrize("stage", ["prepare", "label", "profile", "tune", "evaluate", "preflight", "run"])
@pytest.mark.parametrize("key", ["model.draft", "model.target"])
def test_a_model_that_is_not_there_fails_in_one_line_naming_its_key(stage, key, tmp_path, capsys, monkeypatch):
    """Before anything else (no Ray, no folder, not even the check that earlier stages are complete): in-process,
    with the stage's own entry point replaced by one that records being called."""
    import dataclasses

    import stages

    called = []
    info = stages.STAGES[stage]
    monkeypatch.setitem(stages.STAGES, stage, dataclasses.replace(info, module="stages.cli"))
    monkeypatch.setattr("stages.cli.run", lambda cfg: called.append(cfg), raising=False)
    rc = main([stage, f"output_dir={tmp_path / 'run'}", f"{key}=/nonexistent/model"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert err.splitlines() == [f"blockpilot {stage}: error: {key}: '/nonexistent/model' is neither a local "
                                "folder nor a hub id (a hub id is 'owner/name')"], err
    assert called == [] and not (tmp_path / "run").exists()


def test_on_and_off_are_read_as_written_on_the_command_line_and_in_yaml(tmp_path):
    """YAML 1.1 reads a bare on / off as a boolean; the auto | on | off keys get the word back."""
    cfg = load_config(["engine.compile=off", "vllm.compile=on", "profile.share=on"])
    assert (cfg.engine.compile, cfg.vllm.compile, cfg.profile.share) == ("off", "on", "on")
    (tmp_path / "c.yaml").write_text("engine:\n  compile: on\nprofile:\n  share: off\n")
    cfg = load_config([], str(tmp_path / "c.yaml"))
    assert (cfg.engine.compile, cfg.profile.share) == ("on", "off")

