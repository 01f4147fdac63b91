"""What a user meets first on a cluster, through the CLI and real Ray (the preflight's own local Ray in a fresh
process; the refusals through the CLI's entry point on the session's Ray): ``blockpilot preflight``'s table and its
refusals, a checkpoint whose tensors do not match its class, and a draft changed in place under a label folder.

The checkpoints are copies of the bundled pair with one tensor renamed (safetensors rewritten, config.json kept):
transformers would only warn and initialise the renamed tensor at random, and every tau would be about 1.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import FAST

from pipeline import ASSETS

from .conftest import blockpilot, blockpilot_here

RENAMED = {"draft": ("fc.weight", "fc_renamed.weight"),
           "target": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj_renamed.weight")}


def copy_with(folder, kind: str, edit) -> str:
    """A copy of the bundled tiny ``kind`` whose state dict ``edit`` changes in place."""
    dest = folder / kind
    shutil.copytree(ASSETS / f"tiny-{kind}", dest)
    path = dest / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=meta)
    return str(dest)


def rename(kind: str):
    old, new = RENAMED[kind]
    return lambda t: t.__setitem__(new, t.pop(old))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, ray_session):
    out = tmp_path_factory.mktemp("refusals")
    run = blockpilot_here("prepare", f"output_dir={out}", *FAST)
    assert run.rc == 0, run.tail()
    return out


def fresh(prompts, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(prompts / "prompts", out / "prompts")
    return out


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_a_renamed_tensor_is_refused_naming_it(kind, prompts, tmp_path, ray_session):
    out = fresh(prompts, tmp_path)
    model = copy_with(tmp_path, kind, rename(kind))
    run = blockpilot_here("label", f"output_dir={out}", *FAST, f"model.{kind}={model}")
    old, new = RENAMED[kind]
    assert run.rc == 1, run.tail()
    error = [x for x in run.lines if x.startswith("blockpilot label: error: ")]
    assert error and f"model.{kind}: " in error[0] and f"missing 1: {old}" in error[0] \
        and f"unexpected 1: {new}" in error[0], run.tail()
    assert "preflight refused, nothing started" in error[0] and "Traceback" not in run.output, run.tail()
    assert not (out / "labels" / "_SUCCESS").exists() and not list((out / "labels").glob("part-*.parquet"))


def test_a_draft_changed_in_place_is_refused_on_rerun(prompts, tmp_path, ray_session):
    """Same path, same config.json, new weights (a draft retrained in place): a rerun of label refuses, naming the
    draft's revision before and after; the folder's fingerprint holds the resolved dtype and device kind."""
    out = fresh(prompts, tmp_path)
    draft = copy_with(tmp_path, "draft", lambda t: None)
    first = blockpilot_here("label", f"output_dir={out}", *FAST, f"model.draft={draft}")
    assert first.rc == 0, first.tail()
    fp = json.loads((out / "labels" / "fingerprint.json").read_text())
    assert (fp["dtype"], fp["device"]) == ("float32", "cpu") and fp["draft_revision"].startswith("sha256:")
    assert set(fp["versions"]) == {"torch", "transformers", "dflash"}
    card = (out / "labels" / "README.md").read_text()
    assert "## Provenance" in card and fp["draft_revision"] in card and "float32 on cpu" in card

    config = (tmp_path / "draft" / "config.json").read_text()
    copy_with(tmp_path / "again", "draft", lambda t: t["fc.weight"].mul_(1.01))
    shutil.copy(tmp_path / "again" / "draft" / "model.safetensors", tmp_path / "draft" / "model.safetensors")
    assert (tmp_path / "draft" / "config.json").read_text() == config
    rerun = blockpilot_here("label", f"output_dir={out}", *FAST, f"model.draft={draft}")
    assert rerun.rc == 1, rerun.tail()
    error = [x for x in rerun.lines if x.startswith("blockpilot label: error: ")]
    assert error and "was written with a different config (changed: draft_revision " \
        f"\"{fp['draft_revision']}\" -> \"sha256:" in error[0], rerun.tail()


def test_preflight_prints_its_table_and_refuses_naming_the_key(tmp_path, ray_session):
    ok = blockpilot("preflight", f"output_dir={tmp_path / 'ok'}", *FAST)
    assert ok.proc.returncode == 0, ok.tail()
    assert ok.ray_sessions, "the preflight's own local Ray left no session in its RAY_TMPDIR"  # what is seen below
    head = [i for i, x in enumerate(ok.lines) if "worker" in x and "dtype" in x and "output" in x]
    assert head, ok.tail()
    rows = [x for x in ok.lines[head[0] + 1:] if x.startswith("[label]   ")]  # the table's rows: one per worker
    assert len(rows) == 1 and all("float32" in r and " ok " in r and " rw " in r for r in rows), ok.tail()  # FAST: 1
    assert not (tmp_path / "ok" / ".preflight").exists()  # the probes are cleaned up

    (tmp_path / "file").write_text("a file where output_dir's parent should be\n")
    bad_dir = blockpilot_here("preflight", f"output_dir={tmp_path / 'file' / 'run'}", *FAST)
    assert bad_dir.rc == 1, bad_dir.tail()
    error = [x for x in bad_dir.lines if x.startswith("blockpilot preflight: error: ")]
    assert error and "output_dir: " in error[0] and "is not writable here" in error[0], bad_dir.tail()

    missing = blockpilot("preflight", f"output_dir={tmp_path / 'm'}", *FAST, "model.target=/nonexistent/target")
    assert missing.proc.returncode == 1, missing.tail()
    assert missing.lines[-1] == ("blockpilot preflight: error: model.target: '/nonexistent/target' is neither a "
                                 "local folder nor a hub id (a hub id is 'owner/name')"), missing.tail()
    assert missing.ray_sessions == []  # refused before any work: no Ray was started
