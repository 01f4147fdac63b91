"""Provenance of the loaded models (what a label folder's fingerprint records) and the checkpoint check the preflight
runs without loading weights. Real checkpoints throughout: copies of the bundled pair, edited with safetensors."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from pipeline import ASSETS
from pipeline.decoding import provenance
from pipeline.decoding.models import ModelNotFound, load_draft, load_target
from pipeline.decoding.provenance import check_checkpoint, folder_digest, model_provenance, software_versions
from pipeline.runtime.config import ModelConfig
from random_pair import make_pair
from test_models import rename, rewritten_copy

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    """Each test its own digest cache file (never the user's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(provenance, "_memory", {})
    return tmp_path / "xdg" / "blockpilot" / "file-digests.json"


def _swap_codebooks_to_bare_names(sd):
    """As released DFlash2 checkpoints store them; dflash's loader maps them back (its key_mapping)."""
    for name in ("predecessor_codebook", "successor_codebook"):
        sd[f"candidate_selector.{name}"] = sd.pop(f"candidate_selector.{name}.weight")


def _store_lm_head_only(sd):
    """A tied target storing the one tensor as lm_head: transformers ties the embeddings to it."""
    sd["lm_head.weight"] = sd.pop("model.embed_tokens.weight")


def _narrow_fc(sd):
    sd["fc.weight"] = sd["fc.weight"][:, :-1].contiguous()


def _add_stray(sd):
    sd["stray.weight"] = torch.zeros(2, 2, dtype=torch.float16)


Q = "model.layers.1.self_attn.q_proj.weight"
VARIANTS = {  # name: (kind, source folder, edit or None)
    "bundled target": ("target", "tiny-target", None),
    "bundled draft": ("draft", "tiny-draft", None),
    "tied target storing lm_head": ("target", "tiny-target", _store_lm_head_only),
    "dflash2 with bare codebooks": ("draft", "dflash2", _swap_codebooks_to_bare_names),
    "dflash2 as saved": ("draft", "dflash2", None),
    "renamed draft fc": ("draft", "tiny-draft", rename("fc.weight", "fc_renamed.weight")),
    "renamed target q_proj": ("target", "tiny-target", rename(Q, Q.replace("q_proj", "q_renamed"))),
    "narrowed draft fc": ("draft", "tiny-draft", _narrow_fc),
    "stray draft tensor": ("draft", "tiny-draft", _add_stray),
}
BAD = {"renamed draft fc", "renamed target q_proj", "narrowed draft fc", "stray draft tensor"}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_check_agrees_with_the_loader_without_loading(variant, tmp_path, monkeypatch):
    """check_checkpoint (headers + the class on the meta device) finds exactly the loader's refusal, word for word,
    and passes what the loader loads, including the checkpoints transformers or dflash rename or tie on load."""
    kind, source, edit = VARIANTS[variant]
    if source == "dflash2":
        make_pair(0, dflash2=True)[1].save_pretrained(tmp_path / "saved")
        src = tmp_path / "saved"
    else:
        src = ASSETS / source
    folder = rewritten_copy(src, tmp_path / "m", edit) if edit else src
    key = f"model.{kind}"
    with monkeypatch.context() as m:  # no weights loaded: from_pretrained is refused while the check runs
        def refuse(cls, *a, **k):
            raise AssertionError("check_checkpoint loaded weights")
        m.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
        problems = check_checkpoint(str(folder), None, key, kind)
    loader = load_target if kind == "target" else load_draft
    try:
        loader(ModelConfig(target=str(folder), draft=str(folder)), torch.device("cpu"), torch.float32)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    assert (refusal is not None) == (variant in BAD)
    assert problems == ([refusal] if refusal else [])


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    target, _ = make_pair(0)
    target.save_pretrained(tmp_path / "t", max_shard_size="20KB")
    shards = sorted((tmp_path / "t").glob("model-*.safetensors"))
    assert len(shards) > 2
    assert check_checkpoint(str(tmp_path / "t"), None, "model.target") == []
    shards[1].unlink()
    assert check_checkpoint(str(tmp_path / "t"), None, "model.target") == [
        f"model.target: {tmp_path / 't'}: {shards[1].name}, named by model.safetensors.index.json, is not in "
        f"{tmp_path / 't'}"]


def test_a_folder_without_weights_or_config_is_a_problem(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    shutil.copy(ASSETS / "tiny-draft" / "config.json", tmp_path / "config-only" / "config.json")
    assert check_checkpoint(str(tmp_path / "empty"), None, "model.draft", "draft") == [
        f"model.draft: {tmp_path / 'empty'} has no config.json"]
    [target] = check_checkpoint(str(tmp_path / "empty"), None, "model.target")
    assert target.startswith(f"model.target: {tmp_path / 'empty'}: Unrecognized model")
    assert check_checkpoint(str(tmp_path / "config-only"), None, "model.draft", "draft") == [
        f"model.draft: {tmp_path / 'config-only'}: no weights in {tmp_path / 'config-only'} "
        f"(model.safetensors, its index or *.bin)"]


def test_a_location_that_is_not_there_is_one_line(tmp_path):
    for bad in ["/nonexistent/draft", "not/a/hub/id"]:
        with pytest.raises(ModelNotFound, match=rf"^model\.draft: '{bad}' is neither a local folder nor a hub id"):
            model_provenance(bad, None, "model.draft")
        [problem] = check_checkpoint(bad, None, "model.draft", "draft")
        assert problem.startswith(f"model.draft: '{bad}' is neither") and "\n" not in problem


def test_the_revision_follows_the_weights_not_the_name(tmp_path):
    """A changed weight value under the same config.json changes the revision (a config.json hash alone did not);
    an untouched copy keeps it, and files from_pretrained does not read (README) do not count."""
    bundled = model_provenance("bundled:tiny-draft", None, "model.draft")
    assert bundled["kind"] == "bundled" and bundled["revision"].startswith("sha256:")
    shutil.copytree(ASSETS / "tiny-draft", tmp_path / "copy")
    copy = model_provenance(str(tmp_path / "copy"), None, "model.draft")
    assert copy == {"location": str(tmp_path / "copy"), "kind": "local", "revision": bundled["revision"]}
    (tmp_path / "copy" / "README.md").write_text("edited")
    assert model_provenance(str(tmp_path / "copy"), None, "model.draft")["revision"] == bundled["revision"]

    def nudge(sd):
        sd["fc.weight"][0, 0] += 1

    changed = rewritten_copy(ASSETS / "tiny-draft", tmp_path / "changed", nudge)
    assert (changed / "config.json").read_bytes() == (ASSETS / "tiny-draft" / "config.json").read_bytes()
    assert model_provenance(str(changed), None, "model.draft")["revision"] != bundled["revision"]
    (tmp_path / "copy" / "config.json").write_text((tmp_path / "copy" / "config.json").read_text() + " ")
    assert model_provenance(str(tmp_path / "copy"), None, "model.draft")["revision"] != bundled["revision"]


def test_digests_are_cached_until_the_file_is_rewritten(tmp_path, monkeypatch, digest_cache):
    folder = shutil.copytree(ASSETS / "tiny-draft", tmp_path / "d")
    weights = folder / "model.safetensors"
    reads = []
    real_hash = provenance._sha256_file
    monkeypatch.setattr(provenance, "_sha256_file", lambda p: reads.append(Path(p).name) or real_hash(p))
    first = folder_digest(folder)
    assert sorted(reads) == ["config.json", "model.safetensors"]
    assert str(weights.resolve()) in json.loads(digest_cache.read_text())
    digest_cache.unlink()
    assert folder_digest(folder) == first and len(reads) == 2  # from memory
    monkeypatch.setattr(provenance, "_memory", {})  # a new process, and no cache file: hashed again
    assert folder_digest(folder) == first and len(reads) == 4
    monkeypatch.setattr(provenance, "_memory", {})  # a new process: the cache file written just now
    assert folder_digest(folder) == first and len(reads) == 4

    # Rewritten in place with other bytes of the same size and the old mtime put back (as cp -p, rsync -t do):
    # only the ctime tells, and the file is hashed again.
    st = weights.stat()
    sd = load_file(weights)
    sd["fc.weight"][0, 0] += 1
    tmp = tmp_path / "other.safetensors"
    save_file(sd, tmp, metadata={"format": "pt"})
    assert tmp.stat().st_size == st.st_size
    with open(weights, "r+b") as fh:
        fh.write(tmp.read_bytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_ino == st.st_ino
    assert folder_digest(folder) != first and reads[4:] == ["model.safetensors"]


def test_an_unreadable_digest_cache_is_ignored(tmp_path, digest_cache):
    digest_cache.parent.mkdir(parents=True)
    digest_cache.write_text("{not json")
    expected = folder_digest(ASSETS / "tiny-draft")
    provenance._memory.clear()
    digest_cache.write_text("[1, 2]")
    assert folder_digest(ASSETS / "tiny-draft") == expected
    assert isinstance(json.loads(digest_cache.read_text()), dict)  # rewritten as a cache


def test_software_versions():
    """What each package says of itself (its __version__; dflash has none: the version pyproject.toml pins), not the
    metadata lookup the function itself makes."""
    import torch
    import transformers

    got = software_versions()
    assert got == {"torch": torch.__version__, "transformers": transformers.__version__, "dflash": "0.1.0"}, got


HUB_SCRIPT = """
import json, torch
from pipeline.decoding.models import ModelNotFound, load_target, locate
from pipeline.decoding.provenance import check_checkpoint, model_provenance
from pipeline.runtime.config import ModelConfig
out = {"main": model_provenance("owner/name", None, "model.target"),
       "pinned": model_provenance("owner/name", "%(commit)s", "model.target"),
       "check": check_checkpoint("owner/name", None, "model.target"),
       "check_bad": check_checkpoint("owner/bad", None, "model.target"),
       "hidden": load_target(ModelConfig(target="owner/name"), torch.device("cpu"), torch.float32).config.hidden_size}
for repo, rev in [("owner/absent", None), ("owner/name", "f" * 40)]:
    try:
        locate(repo, rev, "model.draft")
    except ModelNotFound as err:
        out.setdefault("unresolved", []).append(str(err))
print(json.dumps(out))
"""


@pytest.mark.integration  # the integration layer: a fresh interpreter of its own (tests/conftest.py)
def test_a_hub_id_resolves_to_its_cached_commit_offline(tmp_path):
    """A fake huggingface_hub cache (snapshots/<commit>/, refs/main) and HF_HUB_OFFLINE=1, in a fresh process since
    huggingface_hub reads both at import: kind hub and the commit, the check reads the cached headers, the target
    loads from the snapshot, and an id or commit not in the cache is one line naming the key."""
    cache = tmp_path / "hub"
    for repo, edit in [("name", None), ("bad", rename(Q, Q.replace("q_proj", "q_renamed")))]:
        root = cache / f"models--owner--{repo}"
        snapshot = root / "snapshots" / COMMIT
        snapshot.parent.mkdir(parents=True)
        if edit:
            rewritten_copy(ASSETS / "tiny-target", snapshot, edit)
        else:
            shutil.copytree(ASSETS / "tiny-target", snapshot)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(COMMIT)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT % {"commit": COMMIT}], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["main"] == {"location": "owner/name", "kind": "hub", "revision": COMMIT}
    assert out["pinned"] == out["main"]
    assert out["check"] == [] and out["hidden"] == 192
    [bad] = out["check_bad"]
    assert bad.startswith(f"model.target: owner/bad: the checkpoint does not match Qwen3ForCausalLM: missing 1: {Q}")
    assert out["unresolved"] == [
        "model.draft: hub id 'owner/absent' could not be resolved: not in the local hub cache (HF_HUB_OFFLINE is set)",
        f"model.draft: hub id 'owner/name' at revision '{'f' * 40}' could not be resolved: not in the local hub "
        f"cache (HF_HUB_OFFLINE is set)"]


def _digest_in_a_process(path, log, start):
    """A worker starting on the node: waits for the others, then fingerprints the file (each real hash is logged)."""
    from pipeline.decoding import provenance as p

    hashed = p._sha256_file

    def logged(real):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return hashed(real)

    p._sha256_file = logged
    while not os.path.exists(start):
        time.sleep(0.005)
    return p.file_digest(Path(path))


def test_workers_starting_together_on_a_node_hash_a_file_once(tmp_path, digest_cache):
    """Four processes fingerprint one 64 MB weight file at the same moment: one hashes it, the others wait on its
    lock and read the stored digest (before the lock, each of them missed the cache and hashed it: four reads)."""
    import multiprocessing

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(64 * 1024 * 1024))
    log, start = tmp_path / "hashed.log", tmp_path / "start"
    with multiprocessing.get_context("fork").Pool(4) as pool:  # (hashing only: no torch in the children)
        pending = [pool.apply_async(_digest_in_a_process, (str(weights), str(log), str(start))) for _ in range(4)]
        time.sleep(1.0)
        start.touch()
        digests = {p.get(timeout=120) for p in pending}
    assert len(digests) == 1 and digests == {provenance._sha256_file(str(weights))}
    assert len(log.read_text().splitlines()) == 1, log.read_text()
