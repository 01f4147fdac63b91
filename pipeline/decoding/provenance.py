"""What a model location actually holds, for the label folder's fingerprint and the cluster preflight.

:func:`model_provenance` names the bytes: a hub id's resolved commit, a folder's hash of its weights and config, so
that shards labelled with different models (or the same name re-downloaded to other weights) never share a folder.
:func:`check_checkpoint` compares a checkpoint's tensor names and shapes with its class without loading a weight:
what the preflight runs on every node before any model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from pipeline.decoding.models import (ModelNotFound, draft_class, locate, not_matching, read_draft_config,
                                      weight_problems)
from pipeline.io.shards import write_json_atomic
from pipeline.runtime.log import get as log

# The files from_pretrained reads the model from; other files (README, tokenizer, build logs) do not change it.
WEIGHT_FILES = ("config.json", "*.safetensors", "*.bin", "*.pt", "*.index.json")
CHUNK = 8 << 20


def model_provenance(location: str, revision: Optional[str], key: str) -> Dict[str, str]:
    """{location, kind, revision}: for a hub id the commit it resolves to (a pinned commit is itself), for a local
    or bundled folder ``sha256:`` over its weight files and config.json."""
    loc = locate(location, revision, key)
    rev = loc.revision if loc.kind == "hub" else folder_digest(Path(loc.path))
    return {"location": location, "kind": loc.kind, "revision": rev}


def software_versions() -> Dict[str, str]:
    """The packages whose code turns the same weights into different numbers."""
    return {name: version(name) for name in ("torch", "transformers", "dflash")}


def folder_digest(folder: Path) -> str:
    files = sorted({p for pattern in WEIGHT_FILES for p in folder.glob(pattern) if p.is_file()})
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_digest(p)}\n".encode())
    return "sha256:" + h.hexdigest()


# realpath -> (stat key, sha256). The key holds ctime because a user cannot set it: a file rewritten in place
# always gets a new one, even when size and mtime are kept (cp -p, rsync -t, os.utime); the inode and device
# catch a file replaced by a rename.
_memory: Dict[str, Tuple[List[int], str]] = {}


def file_digest(path: Path) -> str:
    """The file's sha256, hashed once per content: an 8B target is ~16 GB, read again by every label worker that
    fingerprints it. Remembered in memory and in digest_cache_file(), keyed by the file's stat."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stat = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    hit = _memory.get(real)
    if hit is not None and hit[0] == stat:
        return hit[1]
    # One hash per file per node: the actors starting together on a node take the file's lock in turn, the first
    # hashes and stores, the others find it stored (before, all 8 missed the cache and each read 16 GB).
    with _lock(real):
        stored = _read_cache().get(real)
        if isinstance(stored, dict) and stored.get("stat") == stat:
            digest = stored["sha256"]
        else:
            digest = _sha256_file(real)
            _remember(real, stat, digest)
    _memory[real] = (stat, digest)
    return digest


def _lock(real: str):
    """A node-wide lock for hashing ``real`` (filelock, beside the digest cache); a cache folder that cannot be
    written gives no lock, and every process hashes on its own as before."""
    from contextlib import nullcontext

    from filelock import FileLock

    folder = digest_cache_file().parent / "locks"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return nullcontext()
    return FileLock(str(folder / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".lock")))


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def digest_cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "blockpilot" / "file-digests.json"


def _read_cache() -> Dict[str, Any]:
    """The stored digests; an unreadable or foreign file counts as empty (it is only a cache)."""
    try:
        stored = json.loads(digest_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _remember(real: str, stat: List[int], digest: str) -> None:
    """Store one digest (replacing the file's older entry, so the cache holds one per file), under the cache's
    lock; an unwritable cache is skipped."""
    try:
        digest_cache_file().parent.mkdir(parents=True, exist_ok=True)
        with _lock("the digest cache"):  # read, add, write: one writer at a time, so no entry is dropped
            stored = _read_cache()
            stored[real] = {"stat": stat, "sha256": digest}
            write_json_atomic(stored, digest_cache_file())
    except OSError:
        pass


# What dflash's DFlash2DraftModel.from_pretrained passes as key_mapping: released DFlash2 checkpoints store the two
# codebooks without ".weight". tests/unit/test_provenance.py checks a checkpoint stored that way both loads and passes.
KEY_MAPPINGS = {"DFlash2DraftModel": {f"candidate_selector.{name}": f"candidate_selector.{name}.weight"
                                      for name in ("predecessor_codebook", "successor_codebook")}}


def check_checkpoint(location: str, revision: Optional[str], key: str, kind: str = "target") -> List[str]:
    """The problems that would stop (or silently spoil) loading ``location`` as the target or the draft, found
    from config.json and the safetensors headers alone: the tensors the class expects, on the meta device, against
    the checkpoint's names and shapes, renamed and tolerated as from_pretrained does (see models.checked)."""
    try:
        loc = locate(location, revision, key)
    except ModelNotFound as err:
        return [str(err)]
    where = f"{key}: {location}"
    try:
        config = _config(loc, kind, key)
    except ModelNotFound as err:
        return [str(err)]
    except (OSError, ValueError) as err:
        return [f"{where}: {_first_line(err)}"]
    try:
        model = _meta_model(config, kind, where)
    except ValueError as err:  # not a dflash draft: draft_class's message names the key
        return [str(err)]
    problems = []
    if kind == "draft" and model.mask_token_id is None:
        problems.append(f"{where}: config has no dflash_config.mask_token_id")
    try:
        header = _local_header(Path(loc.path)) if loc.kind != "hub" else _hub_header(loc.path, loc.revision)
    except FileNotFoundError as err:
        return problems + [f"{where}: {err}"]
    if header is None:
        log("models").info(f"{where}: weight names not compared (no safetensors headers readable without a download)")
        return problems
    found = _compare(model, header, KEY_MAPPINGS.get(type(model).__name__))
    if found:
        problems.append(not_matching(key, location, model, found))
    return problems


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _config(loc, kind: str, key: str):
    if kind == "draft":
        return read_draft_config(loc, key)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(loc.path, revision=loc.revision)


def _meta_model(config, kind: str, where: str):
    """The class the loader would build, with its parameters on the meta device (shapes, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return draft_class(config, where)(config) if kind == "draft" else AutoModelForCausalLM.from_config(config)


def _local_header(folder: Path) -> Optional[Dict[str, Tuple[int, ...]]]:
    """{tensor: shape} of the safetensors checkpoint from_pretrained would read in ``folder`` (the index's shards,
    else model.safetensors); None for weights in another format. FileNotFoundError when a weight file is absent."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        return None
    else:
        raise FileNotFoundError(f"no weights in {folder} (model.safetensors, its index or *.bin)")
    header = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f.name}, named by {index.name}, is not in {folder}")
        with safe_open(str(f), framework="pt") as fh:
            header.update({name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()})
    return header


def _hub_header(repo: str, commit: str) -> Optional[Dict[str, Tuple[int, ...]]]:
    """The headers of a hub checkpoint: from the local cache's snapshot when its weights are there, else (online)
    the hub's ranged reads of them; None when neither can be had without a download."""
    from huggingface_hub import get_safetensors_metadata, is_offline_mode, try_to_load_from_cache

    config = try_to_load_from_cache(repo, "config.json", revision=commit)
    if isinstance(config, str):
        try:
            return _local_header(Path(config).parent)
        except FileNotFoundError:
            pass  # the weights are not downloaded (yet)
    if is_offline_mode():
        return None
    try:
        meta = get_safetensors_metadata(repo, revision=commit)
    except Exception as err:  # noqa: BLE001 - not a safetensors repo, or the hub out of reach: a note, not a problem
        log("models").info(f"{repo}: safetensors headers not readable from the hub: {_first_line(err)}")
        return None
    return {name: tuple(t.shape) for f in meta.files_metadata.values() for name, t in f.tensors.items()}


def _compare(model, header: Dict[str, Tuple[int, ...]], key_mapping) -> List[str]:
    """weight_problems of loading ``header`` into ``model``, mirroring transformers 5.15-5.19's from_pretrained: its key
    renamings (convert_and_load_state_dict_in_model, falling back to the name as stored), then its tying of a
    checkpoint's one copy of tied weights and its per-class ignore patterns (_finalize_model_loading)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    transforms = get_model_conversion_mapping(model, key_mapping)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = model.base_model_prefix
    found, unexpected, mismatched = set(), set(), set()
    for name, shape in header.items():
        new, converter = rename_source_key(name, renamings, converters, prefix, expected)
        if new not in expected and name in expected:
            new, converter = rename_source_key(name, [], [], prefix, expected)
        if new not in expected:
            unexpected.add(name)
            continue
        found.add(new)
        if converter is None and shape != expected[new]:  # a converter (fused experts) reshapes on purpose
            mismatched.add((new, shape, expected[new]))
    import dataclasses

    later = {"skipped_pp_keys": set()}  # fields transformers added after 5.15 (5.19: pipeline-parallel skips)
    have = {f.name for f in dataclasses.fields(LoadStateDictInfo)}
    info = LoadStateDictInfo(missing_keys=set(expected) - found, unexpected_keys=unexpected,
                             mismatched_keys=mismatched, error_msgs=[], conversion_errors={},
                             **{k: v for k, v in later.items() if k in have})
    model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
    model._adjust_missing_and_unexpected_keys(info)
    return weight_problems(info.missing_keys, info.unexpected_keys, info.mismatched_keys)
