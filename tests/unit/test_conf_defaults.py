"""conf/default.yaml is the one source of default values: it holds every key of the schema, and the schema's
defaults (pipeline/runtime/config.py) equal it, leaf by leaf, lists of sources included. Every published config
loads, and the paths the config's comments name exist."""

import re
from typing import Any, List

import pytest
from omegaconf import OmegaConf

from pipeline.runtime import config
from pipeline.runtime.config import DEFAULT_YAML, REPO_ROOT, PipelineConfig, load_config, published_configs


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same kind: a bool never equals a number, an int may equal a float (0 and 0.0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def conf_differences(schema: Any, yaml: Any, key: str = "") -> List[str]:
    """Every way `yaml` (a loaded YAML node) differs from `schema` (``OmegaConf.structured(PipelineConfig)`` or a
    node of it): ``missing KEY`` (in the schema, not in the YAML), ``unknown KEY`` (in the YAML, not in the schema),
    ``KEY: schema X != yaml Y`` (a leaf's value, a list's length). Keys are dotted, list items ``[i]``."""
    if OmegaConf.is_config(schema):
        schema = OmegaConf.to_container(schema, resolve=False)
    if OmegaConf.is_config(yaml):
        yaml = OmegaConf.to_container(yaml, resolve=False)
    out: List[str] = []
    if isinstance(schema, dict) and isinstance(yaml, dict):
        for k in schema:
            sub = f"{key}.{k}" if key else str(k)
            if k not in yaml:
                out.append(f"missing {sub}")
            else:
                out += conf_differences(schema[k], yaml[k], sub)
        out += [f"unknown {key}.{k}" if key else f"unknown {k}" for k in yaml if k not in schema]
    elif isinstance(schema, list) and isinstance(yaml, list):
        if len(schema) != len(yaml):
            out.append(f"{key}: schema has {len(schema)} items != yaml {len(yaml)}")
        for i, (s, y) in enumerate(zip(schema, yaml)):
            out += conf_differences(s, y, f"{key}[{i}]")
    elif isinstance(schema, (dict, list)) or isinstance(yaml, (dict, list)) or not _same(schema, yaml):
        out.append(f"{key}: schema {schema!r} != yaml {yaml!r}")
    return out


def _schema():
    return OmegaConf.structured(PipelineConfig)


def test_default_yaml_holds_every_schema_key_with_the_schema_default():
    assert conf_differences(_schema(), OmegaConf.load(DEFAULT_YAML)) == []


def test_the_comparison_reports_a_changed_value_a_missing_key_and_an_unknown_key():
    yaml = OmegaConf.load(DEFAULT_YAML)
    assert conf_differences(_schema(), yaml) == []
    yaml.label.k = yaml.label.k + 1
    yaml.evaluate.sources[1].split = "label"
    del yaml.prepare.sources[0]["limit"]
    del yaml.train["epochs"]
    yaml.tune.rules = list(yaml.tune.rules) + ["ema:0.5:2"]
    yaml.decode.stop_on_eos = 1  # the same as True to ==, not the same kind
    yaml.ray.extra = 3
    got = conf_differences(_schema(), yaml)
    assert sorted(got) == sorted([
        f"label.k: schema {yaml.label.k - 1} != yaml {yaml.label.k}",
        "evaluate.sources[1].split: schema 'eval' != yaml 'label'",
        "missing prepare.sources[0].limit",
        "missing train.epochs",
        "tune.rules: schema has 9 items != yaml 10",
        "decode.stop_on_eos: schema True != yaml 1",
        "unknown ray.extra",
    ]), got
    # A YAML with fewer sources than the schema's default, and a section replaced by a leaf.
    text = OmegaConf.to_yaml(OmegaConf.load(DEFAULT_YAML))
    yaml = OmegaConf.create(text)
    yaml.evaluate.sources = [yaml.evaluate.sources[0]]
    yaml.profile = 1
    got = conf_differences(_schema(), yaml)
    assert "evaluate.sources: schema has 6 items != yaml 1" in got
    assert any(g.startswith("profile: schema {") for g in got), got


def test_the_default_loads_as_the_schema_alone():
    """Every run merges default.yaml, so the schema's defaults alone must give the same config."""
    assert config.to_yaml(load_config()) == config.to_yaml(load_config(default_yaml=None))


@pytest.mark.parametrize("name", sorted(published_configs()))
def test_every_published_config_loads(name):
    cfg = load_config(config_file=f"published:{name}")
    assert cfg.output_dir == f"runs/published/{name}"


def test_published_configs_are_the_six_shipped():
    assert sorted(published_configs()) == ["llama3.1-8b-instruct", "qwen3-4b", "qwen3-4b-t1", "qwen3-8b",
                                           "qwen3-coder-30b-a3b", "tiny-t1"]


def test_the_tiny_pair_at_t_1_is_the_default_sampled_with_its_own_counts():
    t1, t0 = load_config(config_file="published:tiny-t1"), load_config()
    assert (t1.decode.temperature, t1.train.tau_column, t1.evaluate.samples) == (1.0, "tau_expected", 2)
    assert t1.prepare.limit < t0.prepare.limit and t1.evaluate.limit < t0.evaluate.limit
    assert (t1.model, t1.prepare.sources, t1.evaluate.sources) == (t0.model, t0.prepare.sources, t0.evaluate.sources)


def test_the_papers_own_setting_is_its_recipe_at_t_1():
    """method.md: Qwen3-4B at T = 1, k = 2, the 2-layer MLP of hidden 2048 on raw logits, Adam lr 1e-5, 100 epochs,
    cross-entropy on the argmax-tau label; the same model, draft and sets as the T = 0 config."""
    t1, t0 = load_config(config_file="published:qwen3-4b-t1"), load_config(config_file="published:qwen3-4b")
    assert t1.decode.temperature == 1.0 and t1.label.k == 2 and t1.label.mode == "auto"
    assert (t1.train.model, t1.train.objective, t1.train.label, t1.train.hidden, t1.train.n_layers, t1.train.lr,
            t1.train.epochs, t1.train.input_transform) == ("mlp", "paper", "tau", 2048, 2, 1e-5, 100, "none")
    assert (t1.model, t1.prepare, t1.evaluate.sources) == (t0.model, t0.prepare, t0.evaluate.sources)
    assert t1.evaluate.samples > 1  # a T = 1 speed is measured over draws
    assert t1.output_dir != t0.output_dir


def test_choice_lists_come_from_their_owners():
    from pipeline.policy.blocksize import TRANSFORMS
    from pipeline.runtime import checks

    assert checks._choices()["train.input_transform"] is TRANSFORMS
    assert checks._choices()["model.dtype"] is config.DTYPES is checks.DTYPES


def _conf_texts():
    files = [REPO_ROOT / "pipeline" / "runtime" / "config.py", DEFAULT_YAML, *published_configs().values()]
    return [(f, f.read_text()) for f in files]


def test_paths_named_in_the_config_and_its_comments_exist():
    """No stale module path (pipeline/X.py before the layered sub-packages, pipeline/conf/) and no pointer to a
    missing benchmarks/results file, in config.py or conf/."""
    for f, text in _conf_texts():
        assert "pipeline/conf" not in text and "pipeline.conf" not in text, f
        for path in re.findall(r"\b((?:pipeline|benchmarks|conf|tests|jobs|stages)/[\w./*-]*[\w*])", text):
            pattern = re.sub(r"[A-Z][A-Z_]+", "*", path)  # conf/published/NAME.yaml, benchmarks/results/default-*.md
            assert (REPO_ROOT / path).exists() or any(REPO_ROOT.glob(pattern)), \
                f"{f.name} names {path}, which does not exist"
        for mod in re.findall(r"\bpipeline\.[a-z_]+(?:\.[a-z_]+)*", text):
            parts = mod.split(".")
            while parts and not (REPO_ROOT.joinpath(*parts).with_suffix(".py").is_file()
                                 or (REPO_ROOT.joinpath(*parts) / "__init__.py").is_file()):
                parts.pop()  # pipeline.policy.blocksize.TRANSFORMS: a name inside a module
            assert len(parts) >= 2, f"{f.name} names {mod}, not a module of pipeline"


def test_default_yaml_points_each_measured_choice_to_its_results_file():
    pointers = re.findall(r"chosen by measurement: (benchmarks/results/\S+\.md)", DEFAULT_YAML.read_text())
    assert len(pointers) >= 5
    for p in pointers:
        assert (REPO_ROOT / p).is_file(), p


if __name__ == "__main__":
    pytest.main([__file__])
