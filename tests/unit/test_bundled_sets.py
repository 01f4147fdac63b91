"""The default's prompt sets: one bundled set per kind of text of the tiny pair, split into label and eval by the
same hash rule that prepare applies, so the label sources never hold an evaluation prompt."""

import json

from pipeline.data.bundled import PROMPTS_DIR, list_bundled, load_bundled
from pipeline.data.sources import bundled_split
from pipeline.runtime.config import KINDS, load_config
from pipeline.tiny.prompts import read_jsonl


def test_every_kind_is_a_bundled_set_whose_split_is_its_files():
    cfg = load_config()
    index = json.loads((PROMPTS_DIR / "prompt_sets.json").read_text())
    assert list(index["kinds"]) == list(KINDS) and set(KINDS) <= set(list_bundled())
    for kind in KINDS:
        label, evals = (read_jsonl(PROMPTS_DIR / f"{kind}-{part}.jsonl") for part in ("label", "eval"))
        assert (index["kinds"][kind]["label"], index["kinds"][kind]["eval"]) == (len(label), len(evals))
        # enough for the default's caps (and for the counts the earlier default took, 16 and 208, on request)
        assert len(evals) >= max(16, cfg.evaluate.limit) and len(label) >= max(208, cfg.prepare.limit), kind
        rows = load_bundled(kind)
        for part, expected in (("label", label), ("eval", evals)):
            assert [r["id"] for r in rows if bundled_split(r["id"]) == part] == [r["id"] for r in expected], kind
        assert not {r["text"] for r in label} & {r["text"] for r in evals}, kind
        assert len({r["id"] for r in rows}) == len(rows), kind


def test_the_default_labels_every_kind_and_evaluates_each_apart():
    cfg = load_config([])
    assert [(s.name, s.path, s.split) for s in cfg.prepare.sources] == [(k, k, "label") for k in KINDS]
    assert [(s.name, s.path, s.split) for s in cfg.evaluate.sources] == [
        ("humaneval", "humaneval", None), *((f"{k}-eval", k, "eval") for k in KINDS)]
    # at least 256 training rows: the policy's learning curve is flat from there (benchmarks/results/policy-learning.md)
    t = cfg.train
    assert cfg.prepare.limit * len(KINDS) * (1 - t.val_fraction - t.calibration_fraction) >= 256
