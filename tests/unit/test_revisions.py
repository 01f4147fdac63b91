"""Revisions pinned across stages (issue #51, point 6): the stages after label load the models the labels were made
with. A hub revision the config leaves null is the labels' commit; another revision, or a local folder whose weights
changed since, is refused naming both. Before, each stage resolved "main" again, and a draft pushed between label and
evaluate was evaluated without a word."""

import json

import pytest
from omegaconf import OmegaConf

from pipeline.evaluation.deploy import pinned_draft_revision
from pipeline.io.shards import labels_revisions
from pipeline.runtime.config import load_config
from stages.decoding import DecodingStage

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Later(DecodingStage):
    """A decoding stage after label (tune's and evaluate's revision handling), reading ``labels``' fingerprint."""

    name = "later"

    def __init__(self, cfg, labels):
        super().__init__(cfg, labels.parent / "later", labels.parent / "prompts", 1, "later.num_workers")
        self.labels = labels

    def recorded_revisions(self):
        return labels_revisions(self.labels)


def labelled(tmp_path, **revisions):
    labels = tmp_path / "labels"
    labels.mkdir(parents=True)
    (labels / "fingerprint.json").write_text(json.dumps({"target": "t", "draft": "d", **revisions}))
    return labels


def test_the_labels_models_pass_and_changed_weights_are_refused_naming_both(tmp_path):
    cfg = load_config([f"output_dir={tmp_path}"])
    now = Later(cfg, labelled(tmp_path / "a")).provenance  # what the bundled pair hashes to
    same = {"target_revision": now["model.target"]["revision"], "draft_revision": now["model.draft"]["revision"]}
    Later(cfg, labelled(tmp_path / "b", **same)).check_revisions()  # the same weights: no refusal
    changed = {**same, "draft_revision": "sha256:" + "0" * 64}
    with pytest.raises(ValueError) as refused:
        Later(cfg, labelled(tmp_path / "c", **changed)).check_revisions()
    message = str(refused.value)
    assert message.startswith(f"model.draft: bundled:tiny-draft is {same['draft_revision']} now, but the labels "
                              f"were made with sha256:{'0' * 64}"), message


def test_a_null_hub_revision_is_the_labels_commit_and_a_local_digest_pins_nothing(tmp_path):
    cfg = load_config([f"output_dir={tmp_path}", "model.target=owner/target", "model.draft=owner/draft"])
    stage = Later(cfg, labelled(tmp_path, target_revision=COMMIT, draft_revision="sha256:" + "1" * 64))
    assert stage.pinned_model.target_revision == COMMIT  # the hub commit the labels were made with
    assert stage.pinned_model.draft_revision is None  # a folder's digest is no revision to load
    mine = load_config([f"output_dir={tmp_path}", "model.target=owner/target", "model.target_revision=v2"])
    assert Later(mine, tmp_path / "labels").pinned_model.target_revision == "v2"  # the config's own wins


def test_deploy_serves_the_labels_draft_commit_and_refuses_another(tmp_path):
    labels = labelled(tmp_path, draft_revision=COMMIT)
    cfg = OmegaConf.create({"model": {"draft_revision": None}})
    assert pinned_draft_revision(cfg, labels) == COMMIT
    with pytest.raises(ValueError, match=f"model.draft_revision: main is not the commit the labels were made with "
                                         f"\\({COMMIT}"):
        pinned_draft_revision(OmegaConf.create({"model": {"draft_revision": "main"}}), labels)
    assert pinned_draft_revision(cfg, labelled(tmp_path / "local", draft_revision="sha256:" + "2" * 64)) is None
