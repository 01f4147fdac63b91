"""Loading the target, the DFlash draft and the tokenizer from a hub id, a local folder or a bundled name.

Every path that reads a model location goes through :func:`locate`, so that a location that is not there fails in
one line naming its config key; the loaders refuse a checkpoint whose tensors do not match the class (transformers
only warns and initialises the missing ones at random: labels made with such a model are silently garbage)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from pipeline.runtime.config import ModelConfig
from pipeline.runtime.log import get as log

from pipeline import ASSETS
BUNDLED_PREFIX = "bundled:"


class ModelNotFound(FileNotFoundError):
    """A model location that is neither a bundled name, a local folder nor a reachable hub id. A FileNotFoundError,
    so that the CLI prints its one line without a traceback."""


@dataclass(frozen=True)
class Located:
    """What a location names: ``path`` is what from_pretrained reads (a folder, or the hub id), ``revision`` the
    commit a hub id resolved to (None for a folder), ``kind`` one of bundled / local / hub."""
    path: str
    revision: Optional[str]
    kind: str


def locate(location: str, revision: Optional[str], key: str) -> Located:
    """The one reading of a model location (``key`` is its config key, e.g. ``model.draft``, for the error)."""
    if location.startswith(BUNDLED_PREFIX):
        path = ASSETS / location[len(BUNDLED_PREFIX):]
        if not path.is_dir():
            raise ModelNotFound(f"{key}: bundled model {location!r} not found at {path}")
        return Located(str(path), None, "bundled")
    if Path(location).is_dir():
        return Located(location, None, "local")
    if not is_hub_id(location):
        raise ModelNotFound(f"{key}: {location!r} is neither a local folder nor a hub id (a hub id is 'owner/name')")
    return Located(location, hub_commit(location, revision, key), "hub")


def locate_all(cfg: ModelConfig) -> None:
    """Every model location of the config located (the tokenizer's too): a stage that reads models calls it before
    anything else, so that a path that is not there fails first, in one line naming its key."""
    locate(cfg.target, cfg.target_revision, "model.target")
    locate(cfg.draft, cfg.draft_revision, "model.draft")
    if cfg.tokenizer:
        locate(cfg.tokenizer, None, "model.tokenizer")


def is_hub_id(location: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(location)
    except HFValidationError:
        return False
    return location.count("/") == 1  # validate_repo_id also takes an owner-less 'name'


@functools.lru_cache(maxsize=None)
def hub_commit(repo: str, revision: Optional[str], key: str) -> str:
    """The commit ``revision`` (None = main) of a hub repo names. Cached for the process, so that the target a
    worker loads and the revision its labels record are the same commit even if the branch moves meanwhile.
    Offline: the local cache's. Online: the hub's, else the cache's (a node without network but not marked offline
    loads from the cache, as transformers does)."""
    from huggingface_hub import HfApi, is_offline_mode

    what = f"{key}: hub id {repo!r}" + (f" at revision {revision!r}" if revision else "")
    if is_offline_mode():
        commit = cached_commit(repo, revision)
        if commit is None:
            raise ModelNotFound(f"{what} could not be resolved: not in the local hub cache (HF_HUB_OFFLINE is set)")
        return commit
    try:
        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        return with_hub_retries(lambda: api.model_info(repo, revision=revision).sha, what)
    except Exception as err:  # noqa: BLE001 - any failure to reach it: network, 404, gated, bad revision
        commit = cached_commit(repo, revision)
        if commit is None:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise ModelNotFound(f"{what} could not be resolved: {lines[0]}") from err
        return commit


# A hub call that fails for a moment (a 429 or 5xx, a dropped connection) is retried with jittered exponential
# backoff: 64 workers starting at once meet the hub's rate limit together, and one refusal used to refuse the run.
# (Hand-written: tenacity / backoff would do it, and are not in the stack; huggingface_hub's http_backoff wraps raw
# requests, not HfApi's calls.)
HUB_ATTEMPTS = 5  # waits of about 1, 2, 4, 8 s in between
HUB_RETRY_BASE_S = 1.0
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
TRANSIENT_ERRORS = {"ConnectionError", "TimeoutError", "Timeout", "TransportError", "TimeoutException",
                    "RemoteProtocolError"}


def transient_hub_error(err: BaseException) -> bool:
    """A failure worth another try: an HTTP status the hub answers when busy, or the connection itself failing
    (httpx's and requests' exception families, by name). Not a 404, 401, gated repo or bad revision, and not a host
    name that does not resolve (EAI_NONAME: no DNS answer for it, on a machine without network, is no moment's
    failure; it cost every offline process 20 s of waits before the cache's commit; a DNS server that fails for a
    moment, EAI_AGAIN, is retried)."""
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status is not None:
        return status in TRANSIENT_STATUS
    return bool({c.__name__ for c in type(err).__mro__} & TRANSIENT_ERRORS) and not _name_unknown(err)


def _name_unknown(err: Optional[BaseException]) -> bool:
    """Whether ``err`` comes, through its causes, from a host name with no DNS answer (socket.EAI_NONAME)."""
    import socket

    for _ in range(12):  # httpx.ConnectError <- httpcore.ConnectError <- socket.gaierror
        if err is None:
            return False
        if isinstance(err, socket.gaierror) and err.errno == socket.EAI_NONAME:
            return True
        err = err.__cause__ or err.__context__
    return False


def with_hub_retries(call, what: str, attempts: Optional[int] = None, sleep=None):
    """``call()``, retried on :func:`transient_hub_error` up to ``attempts`` times in all (HUB_ATTEMPTS)."""
    import random
    import time

    attempts, sleep = attempts or HUB_ATTEMPTS, sleep or time.sleep
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - re-raised unless transient and a try is left
            if attempt == attempts or not transient_hub_error(err):
                raise
            wait = HUB_RETRY_BASE_S * 2 ** (attempt - 1) * (1 + random.random() / 2)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            log("models").warning(f"{what}: {first}; trying again in {wait:.1f} s ({attempt}/{attempts - 1})")
        sleep(wait)


def cached_commit(repo: str, revision: Optional[str]) -> Optional[str]:
    """The commit of ``revision`` in the huggingface_hub cache (its snapshots/<commit>/ folder), None if absent."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, "config.json", revision=revision or "main")
    return Path(found).parent.name if isinstance(found, str) else None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 is the serving dtype on GPUs; fp32 on CPU keeps T=0 runs bit-reproducible.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


@dataclass
class LoadedModels:
    target: Any
    draft: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    stop_token_ids: List[int]

    @property
    def block_size(self) -> int:
        return int(self.draft.block_size)

    @property
    def vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().weight.shape[0])


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    if cfg.tokenizer is None:
        loc = locate(cfg.target, cfg.target_revision, "model.target")
    else:
        loc = locate(cfg.tokenizer, None, "model.tokenizer")
    return AutoTokenizer.from_pretrained(loc.path, revision=loc.revision, trust_remote_code=cfg.trust_remote_code)


def weight_problems(missing: Iterable[str], unexpected: Iterable[str],
                    mismatched: Iterable[Tuple[str, Any, Any]], shown: int = 5) -> List[str]:
    """One phrase per kind of disagreement between a checkpoint and its class, naming the first ``shown`` tensors;
    ``mismatched`` holds (name, checkpoint shape, model shape)."""
    def names(items) -> str:
        return ", ".join(items[:shown]) + (", ..." if len(items) > shown else "")

    out = []
    for what, items in (("missing", sorted(missing)), ("unexpected", sorted(unexpected))):
        if items:
            out.append(f"{what} {len(items)}: {names(items)}")
    sizes = [f"{n} (checkpoint {list(c)}, model {list(m)})" for n, c, m in sorted(mismatched, key=lambda x: x[0])]
    if sizes:
        out.append(f"size-mismatched {len(sizes)}: {names(sizes)}")
    return out


def checked(loaded, key: str, location: str):
    """The model of ``from_pretrained(..., output_loading_info=True)``, or a refusal naming what did not match.
    Nothing is tolerated: transformers already leaves out of the report the tied weights it ties (lm_head of a
    tie_word_embeddings target) and non-persistent buffers (rotary inv_freq), which are not in the checkpoint;
    measured on the bundled pair and tests/random_pair.py's pairs (DFlash2 too), which all report nothing."""
    model, info = loaded
    # info["error_msgs"] is always empty here: transformers raises on those itself.
    problems = weight_problems(info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"])
    if problems:
        raise ValueError(not_matching(key, location, model, problems))
    return model


def not_matching(key: str, location: str, model, problems: List[str]) -> str:
    """The one line of a checkpoint that does not match its class (the loader's refusal, the preflight's problem)."""
    return f"{key}: {location}: the checkpoint does not match {type(model).__name__}: " + "; ".join(problems)


# ignore_mismatched_sizes: a size mismatch comes back in the loading info (and is refused by `checked`, naming
# it) instead of as transformers' RuntimeError pointing at a report in the log.
LOADING_INFO = dict(output_loading_info=True, ignore_mismatched_sizes=True)


def load_target(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    loc = locate(cfg.target, cfg.target_revision, "model.target")
    loaded = AutoModelForCausalLM.from_pretrained(loc.path, revision=loc.revision, dtype=dtype,
                                                  trust_remote_code=cfg.trust_remote_code,
                                                  **straight_to(device), **LOADING_INFO)
    return checked(loaded, "model.target", cfg.target).to(device).eval()  # (.to: a no-op once there)


def straight_to(device: torch.device) -> Dict[str, Any]:
    """from_pretrained's arguments that put each tensor on ``device`` as it is read (transformers' single-device
    ``device_map``, which needs accelerate installed and adds no dispatch hooks), instead of the whole model in host
    memory first and then a copy: 8 label actors of a node loading an 8B target each held 16 GB of host memory at
    once that way."""
    return {"device_map": {"": device}}


DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")  # the dflash.model classes a draft can be


def draft_classes() -> Dict[str, type]:
    """{name: class} of DRAFT_ARCHITECTURES: the classes the loader builds, and so the only ones replay labelling
    accepts. A function, so that importing the loader does not import dflash."""
    import dflash.model

    return {name: getattr(dflash.model, name) for name in DRAFT_ARCHITECTURES}


def draft_class(config, where: str) -> type:
    """The draft class its config names (``architectures``; none = DFlashDraftModel), so that a DFlash2 checkpoint
    gets its convolutions and candidate selector. Only dflash's own classes: no remote code."""
    archs = config.architectures or []
    name = archs[0] if len(archs) == 1 else "DFlashDraftModel"
    if name not in DRAFT_ARCHITECTURES:
        raise ValueError(f"{where}: architecture {archs} is not a dflash draft ({', '.join(DRAFT_ARCHITECTURES)})")
    return draft_classes()[name]


def draft_config(cfg: ModelConfig):
    """The draft's config as the loader reads it, without weights: the one place that reads it (B, the draft class,
    and what replay checks all come from here)."""
    return read_draft_config(locate(cfg.draft, cfg.draft_revision, "model.draft"), "model.draft")


def read_draft_config(loc: Located, key: str):
    """A folder without config.json is refused: the draft's config class would quietly build a default Qwen3Config
    (and the draft class then fail on a missing attribute)."""
    from dflash.model import DFlashDraftModel

    if loc.kind != "hub" and not (Path(loc.path) / "config.json").is_file():
        raise ModelNotFound(f"{key}: {loc.path} has no config.json")
    return DFlashDraftModel.config_class.from_pretrained(loc.path, revision=loc.revision)


def load_draft(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    loc = locate(cfg.draft, cfg.draft_revision, "model.draft")
    cls = draft_class(draft_config(cfg), f"model.draft: {cfg.draft}")
    model = checked(cls.from_pretrained(loc.path, revision=loc.revision, dtype=dtype, **straight_to(device),
                                        **LOADING_INFO), "model.draft", cfg.draft)
    if model.mask_token_id is None:
        raise ValueError(f"model.draft: {cfg.draft}: config has no dflash_config.mask_token_id")
    return model.to(device).eval()


def stop_token_ids(tokenizer, target=None) -> List[int]:
    """The eos ids of the tokenizer and of the target's generation config (Qwen3 uses two)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(target, "generation_config", None) if target is not None else None
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(i) for i in eos)
    return sorted(ids)


def load_models(cfg: ModelConfig) -> LoadedModels:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg)
    target = load_target(cfg, device, dtype)
    draft = load_draft(cfg, device, dtype)
    return LoadedModels(target, draft, tokenizer, device, dtype, stop_token_ids(tokenizer, target))

