"""Prompt sources: opening every source kind (file readers in :mod:`pipeline.data.readers`) and :func:`stream_prompts`
(one row at a time; :func:`build_prompts`: in one list), shared by ``prepare`` and ``evaluate``.

Free of Ray: plain Python over files, ``datasets`` and the bundled sets.

Source kinds (``SourceConfig.kind``) and how each is read
---------------------------------------------------------
Every reader yields records in source order; ``source_row`` is the 0-based index of the record in its source
(over all the source's files, in sorted path order). File-level problems are recorded with ``source_row`` None
and the ``file``. Local files are read as bytes and decoded as UTF-8 (a leading byte-order mark is dropped; CRLF
line endings are fine).

``bundled``
    ``pipeline.data.bundled.load_bundled(path)`` -> ``[{"id", "text"}]``. ``source_row`` is the index in the full
    list. ``split``: None = every prompt; ``"label"`` / ``"eval"`` = a fixed 90/10 partition by the bundled id:
    a prompt is in ``eval`` iff ``int(sha256(id)[:8], 16) % 10 == 0`` (see :func:`bundled_split`), so evaluation
    prompts are never labelled or trained on. The prompt is the ``text`` field (a ``template`` sees ``id`` and
    ``text``).
``hf``
    ``datasets.load_dataset(path, name=hf_config, split=split or "train")``: ``path`` is a hub id or a local
    dataset folder (data files that ``datasets`` recognises; a ``save_to_disk`` folder is read with
    ``load_from_disk``). A local single file is read with the builder of its extension (parquet / json /
    jsonl / csv / txt). The prompt is ``field`` or the ``template``.
``jsonl``
    One JSON object per line. ``path`` is a file, or a folder whose ``*.jsonl`` files are read (recursively,
    sorted). The file is read as bytes and decoded line by line, so one bad line is rejected
    (``undecodable`` / ``malformed_json`` / ``nul_bytes`` / ``wrong_type``) and every other line is kept.
    Blank lines are skipped and are not rows.
``json``
    A JSON array of objects per file (``*.json`` in a folder). Invalid UTF-8 bytes inside a string reject only
    that row (``undecodable``); an unparsable file or a top-level value that is not an array is one file-level
    reject (``malformed_json`` / ``wrong_type``).
``parquet``
    ``*.parquet`` files, read in row batches; an unreadable file is one file-level ``wrong_format`` reject.
``text``
    A ``.txt`` FILE is one prompt per line: each line without its line ending; blank or whitespace-only lines
    are skipped and are not rows (BlockPilot's TXT convention). A FOLDER is one prompt per ``*.txt`` file (the
    whole file, trailing newlines removed; an empty file is rejected as ``empty``). The prompt field is ``text``.
``sharegpt``
    Conversations ``{"conversations": [{"from": "human"|"user"|"gpt"|..., "value": ...}, ...]}`` (``role`` /
    ``content`` keys are accepted too) from local ``*.json`` / ``*.jsonl`` files (read as above) or, when
    ``path`` is not a local path, from the hub via ``datasets.load_dataset``. The prompt is the FIRST human /
    user turn; a ``template`` sees the row's fields plus ``text`` = that turn.

A folder read for a file kind takes the files with that kind's extensions; every other file in it (hidden files
excepted) is recorded as a file-level ``wrong_format`` reject and skipped. A file with no rows gives no prompts
and is listed in the source's ``empty_files`` (and in ``notes``).

Prompt text and rejects
-----------------------
``template`` (Python ``str.format`` over the row's fields, indexing allowed: ``"{prompt[0]}"``) overrides
``field``. Reject reasons (:data:`REJECT_REASONS`): ``missing_field`` (field / template key absent or null, no
human turn), ``wrong_type`` (the value is not a string, or a template indexes into one), ``malformed_json``,
``undecodable`` (invalid UTF-8 bytes, lone surrogates), ``nul_bytes``, ``empty`` (empty or whitespace-only),
``too_long`` (more than ``max_prompt_tokens`` tokens after the chat template), ``duplicate`` (same ``prompt_id``
as an earlier prompt; dropped and counted) and ``wrong_format`` (file-level, see above).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from pipeline.data.prompt_text import check_template, row_text, text_problem
from pipeline.data.readers import (
    EXTENSIONS,
    Record,
    Reject,
    RowCounter,
    list_files,
    read_source_file,
    sharegpt_fields,
)
from pipeline.data.schemas import prompt_id
from pipeline.runtime.config import ConfigError, SourceConfig

REJECT_REASONS = ("empty", "undecodable", "missing_field", "wrong_type", "malformed_json", "nul_bytes", "too_long",
                  "duplicate", "wrong_format")
FILE_KINDS = ("jsonl", "json", "parquet", "text")
BUNDLED_SPLITS = (None, "label", "eval")
DETAIL_CHARS = 200


def bundled_split(bundled_id: str) -> str:
    """``"eval"`` for one bundled prompt in ten (by a hash of its id), else ``"label"``; fixed forever."""
    return "eval" if int(hashlib.sha256(str(bundled_id).encode("utf-8")).hexdigest()[:8], 16) % 10 == 0 else "label"


def _short(text: str) -> str:
    text = str(text)
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


# ---- path checks -------------------------------------------------------------------------------------------------


def _is_local_like(path: str) -> bool:
    """Looks like a filesystem path rather than a hub id (``org/name`` or ``name``)."""
    return (path.startswith(("/", "./", "../", "~")) or path in (".", "..") or "\\" in path or path.count("/") > 1
            or Path(path).suffix.lower() in (".json", ".jsonl", ".parquet", ".txt", ".csv", ".arrow"))


def _local(path: str) -> Path:
    return Path(path).expanduser()


def _src_label(src: SourceConfig) -> str:
    return f"source {src.name!r} (kind {src.kind}, path {src.path!r})"


def validate_sources(sources: Sequence[SourceConfig], section: str = "prepare") -> None:
    """Cheap checks of every source before any work: local paths exist, templates parse, splits make sense.

    Raises ``FileNotFoundError`` (a missing path, naming the source) or ``ConfigError`` (naming the key).
    """
    if not sources:
        raise ConfigError(f"config key '{section}.sources': no prompt source given")
    for i, src in enumerate(sources):
        key = f"{section}.sources[{i}]"
        if src.template is not None:
            check_template(src.template, f"{key}.template")
        if src.kind == "bundled":
            from pipeline.data.bundled import list_bundled

            if src.path not in list_bundled():
                raise ConfigError(f"config key '{key}.path': unknown bundled prompt set {src.path!r}; choose from "
                                  f"{', '.join(list_bundled())}")
            if src.split not in BUNDLED_SPLITS:
                raise ConfigError(f"config key '{key}.split': {src.split!r} is not one of None, label, eval "
                                  "(bundled sets)")
        elif src.kind in FILE_KINDS:
            if not _local(src.path).exists():
                raise FileNotFoundError(f"{_src_label(src)}: path does not exist")
        elif src.kind in ("hf", "sharegpt"):
            if not _local(src.path).exists() and _is_local_like(src.path):
                raise FileNotFoundError(f"{_src_label(src)}: path does not exist (and it is not a hub id)")
        else:
            raise ConfigError(f"config key '{key}.kind': {src.kind!r} is not a source kind")


# ---- opened sources ----------------------------------------------------------------------------------------------


@dataclass
class _Opened:
    src: SourceConfig
    records: Callable[[], Iterator[Any]]
    default_field: Optional[str] = None  # the implicit prompt field (text / bundled / sharegpt)
    files: List[str] = field(default_factory=list)
    empty_files: List[str] = field(default_factory=list)
    sharegpt: bool = False


def _load_hf(src: SourceConfig):
    import datasets

    split = src.split or "train"
    local = _local(src.path)
    try:
        if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f'unknown split "{split}"; has {", ".join(ds)}')
                ds = ds[split]
            return ds
        if local.is_file():
            builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text",
                       ".arrow": "arrow"}.get(local.suffix.lower())
            if builder is None:
                raise ValueError(f"cannot tell the format of {local.name}; give a folder or a hub id")
            return datasets.load_dataset(builder, data_files=str(local), split=split)
        return datasets.load_dataset(str(local) if local.exists() else src.path, name=src.hf_config, split=split)
    except Exception as err:  # noqa: BLE001 - hub / format errors become one clear message naming the source
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{_src_label(src)}: datasets could not load it "
                         f"(config {src.hf_config!r}, split {split!r}): {type(err).__name__}: {_short(msg)}") from None


def _hf_records(ds) -> Callable[[], Iterator[Any]]:
    def gen():
        for i, item in enumerate(ds):
            yield Record(i, dict(item))
    return gen


def _file_records(src: SourceConfig, opened: _Opened, per_file: bool = False) -> None:
    root = _local(src.path)
    if root.is_dir():
        files, other = list_files(root, src.kind)
    else:
        files, other = [root], []
    opened.files = [str(p) for p in files]

    def gen():
        rows = RowCounter()
        for p in other:
            yield Reject("wrong_format", f"{p.relative_to(root).as_posix()}: not a {'/'.join(EXTENSIONS[src.kind])} "
                         f"file (kind {src.kind}); skipped", None, str(p))
        for p in files:
            n_items = 0
            for item in read_source_file(p, rows, src.kind, per_file):
                n_items += 1
                yield item
            if n_items == 0:  # a 0-row file (a broken file is a reject instead)
                opened.empty_files.append(str(p))
    opened.records = gen


def open_source(src: SourceConfig) -> _Opened:
    """Open one source (loads hub / bundled data, lists files); rows are read lazily by ``records()``."""
    opened = _Opened(src, lambda: iter(()))
    if src.kind == "bundled":
        from pipeline.data.bundled import load_bundled

        try:
            items = load_bundled(src.path)
        except KeyError as err:
            raise ValueError(f"{_src_label(src)}: {err.args[0]}") from None
        opened.default_field = "text"

        def gen():
            for i, item in enumerate(items):
                if src.split is not None and bundled_split(item["id"]) != src.split:
                    continue
                yield Record(i, dict(item))
        opened.records = gen
    elif src.kind == "hf":
        opened.records = _hf_records(_load_hf(src))
    elif src.kind == "sharegpt":
        opened.default_field, opened.sharegpt = "text", True
        if _local(src.path).exists():
            _file_records(src, opened)
        else:
            opened.records = _hf_records(_load_hf(src))
    elif src.kind == "text":
        opened.default_field = "text"
        _file_records(src, opened, per_file=_local(src.path).is_dir())
    elif src.kind in ("jsonl", "json", "parquet"):
        _file_records(src, opened)
    else:  # validate_sources catches this first
        raise ConfigError(f"source {src.name!r}: unknown kind {src.kind!r}")
    return opened


# ---- build_prompts / stream_prompts ----------------------------------------------------------------------------------


def effective_limit(src: SourceConfig, limit: Optional[int]) -> Optional[int]:
    caps = [c for c in (limit, src.limit) if c is not None]
    return min(caps) if caps else None


def _reject_dict(src_name: str, r: Reject) -> Dict[str, Any]:
    return {"source": src_name, "source_row": r.row, "prompt_id": r.prompt_id, "reason": r.reason,
            "detail": _short(r.detail), "file": r.file}


SLOW_SOURCE_S = 2.0  # a source read for longer than this gets its line in a default log (progress on long reads)


def build_prompts(sources: Sequence[SourceConfig], tokenizer, max_prompt_tokens: int,
                  apply_chat_template: bool = True, enable_thinking: bool = False, limit: Optional[int] = None, *,
                  section: str = "prepare", log: Optional[Callable[[str], None]] = None,
                  debug: Optional[Callable[[str], None]] = None,
                  require_any: bool = True) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], Dict[str, Any]]:
    """Read every source and build the prompt rows: :func:`stream_prompts`' rows in one list (for the few prompts of
    tests and benchmarks; prepare streams them)."""
    rows, rejects, stats = stream_prompts(sources, tokenizer, max_prompt_tokens, apply_chat_template,
                                          enable_thinking, limit, section=section, log=log, debug=debug,
                                          require_any=require_any)
    return list(rows), rejects, stats


def stream_prompts(sources: Sequence[SourceConfig], tokenizer, max_prompt_tokens: int,
                   apply_chat_template: bool = True, enable_thinking: bool = False, limit: Optional[int] = None, *,
                   section: str = "prepare", log: Optional[Callable[[str], None]] = None,
                   debug: Optional[Callable[[str], None]] = None,
                   require_any: bool = True) -> Tuple[Iterator[Dict[str, Any]], List[Dict[str, Any]], Dict[str, Any]]:
    """Read every source and build the prompt rows, one at a time: a million prompts (their token ids and text, many
    GB) are never held at once, only a set of their ids (the duplicate check).

    Returns ``(rows, rejects, stats)``: ``rows`` iterates dicts with exactly the columns of
    ``pipeline.data.schemas.PROMPTS_SCHEMA`` (sources in the given order, rows in source order); ``rejects`` (dicts
    ``{source, source_row, prompt_id, reason, detail, file}``) and ``stats`` fill as ``rows`` is read and are
    complete once it is exhausted. ``stats`` holds per-source counts (``read``, ``accepted``, ``rejected``,
    ``duplicates``, ``rejects_by_reason``, ``limit``, ``limit_reached``, ``files``, ``empty_files``),
    ``rejects_by_reason``, ``rejects_by_source``, ``duplicates``, ``notes``, ``prompts`` (accepted in all) and
    ``longest_prompt`` (the most ``prompt_tokens`` of any, 0 for none: what the decoding stages' memory plans are
    sized for, recorded by prepare so that no worker reads every shard for it).

    Every source is validated and opened before this returns (before any row is read). ``limit`` caps the ACCEPTED
    prompts of each source (a source's own ``limit`` wins when smaller). Exhausting ``rows`` raises ``ValueError``
    when nothing is accepted and ``require_any``.
    """
    log = log or (lambda msg: None)
    debug = debug or (lambda msg: None)
    validate_sources(sources, section)
    opened = [open_source(src) for src in sources]
    rejects: List[Dict[str, Any]] = []
    stats: Dict[str, Any] = {"sources": {}, "notes": []}
    settings = (tokenizer, max_prompt_tokens, apply_chat_template, enable_thinking)
    return _rows(opened, settings, limit, rejects, stats, log, debug, require_any), rejects, stats


def _rows(opened: List[_Opened], settings: Tuple[Any, int, bool, bool], limit: Optional[int],
          rejects: List[Dict[str, Any]], stats: Dict[str, Any], log: Callable[[str], None],
          debug: Callable[[str], None], require_any: bool) -> Iterator[Dict[str, Any]]:
    from pipeline.data.chat import format_prompt

    tokenizer, max_prompt_tokens, apply_chat_template, enable_thinking = settings
    seen: set = set()  # prompt ids as ints (96 bits): about half the memory of their hex strings, at 1M prompts
    by_reason: Counter = Counter()
    total = longest = 0

    for op in opened:
        src = op.src
        t0 = time.time()
        cap = effective_limit(src, limit)
        s_reasons: Counter = Counter()
        read = accepted = 0

        def reject(r: Reject) -> None:
            rejects.append(_reject_dict(src.name, r))
            s_reasons[r.reason] += 1

        for rec in op.records():
            if cap is not None and accepted >= cap:
                break
            if isinstance(rec, Reject):
                read += rec.row is not None
                reject(rec)
                continue
            read += 1
            fields = rec.fields
            if op.sharegpt:
                fields, problem = sharegpt_fields(fields)
                if problem:
                    reject(Reject(*problem, rec.row, rec.file))
                    continue
            text, problem = row_text(src, fields, op.default_field if src.template is None else None)
            problem = problem or text_problem(text)
            if problem:
                reject(Reject(*problem, rec.row, rec.file))
                continue
            pid = prompt_id(src.name, text)
            key = int(pid, 16)
            if key in seen:
                reject(Reject("duplicate", "same prompt_id as an earlier prompt", rec.row, rec.file, pid))
                continue
            seen.add(key)
            prompt = format_prompt(tokenizer, text, apply_chat_template, enable_thinking)
            ids = list(tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"])
            if len(ids) > max_prompt_tokens:
                reject(Reject("too_long", f"{len(ids)} tokens > max_prompt_tokens {max_prompt_tokens}", rec.row,
                              rec.file, pid))
                continue
            yield {"prompt_id": pid, "source": src.name, "source_row": int(rec.row), "text": text,
                   "prompt": prompt, "input_ids": ids, "prompt_tokens": len(ids)}
            accepted += 1
            longest = max(longest, len(ids))

        by_reason.update(s_reasons)
        total += accepted
        limit_reached = cap is not None and accepted >= cap
        stats["sources"][src.name] = {
            "kind": src.kind, "path": src.path, "read": read, "accepted": accepted,
            "rejected": sum(s_reasons.values()), "duplicates": s_reasons.get("duplicate", 0),
            "rejects_by_reason": dict(sorted(s_reasons.items())), "limit": cap, "limit_reached": limit_reached,
            "files": len(op.files), "empty_files": list(op.empty_files),
        }
        for f in op.empty_files:
            stats["notes"].append(f"source {src.name!r}: file {f} has no rows")
        if accepted == 0:
            stats["notes"].append(f"source {src.name!r}: no prompt accepted")
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s_reasons.items())) or "none"
        # One line a source, once read: what it is and what it gave. Shown where it says more than the stage's
        # closing "prompts per source" line (rejects, an empty file, a read that took a while); at debug otherwise.
        seconds = time.time() - t0
        (log if s_reasons or op.empty_files or seconds >= SLOW_SOURCE_S else debug)(
            f"source {src.name!r} ({src.kind} {src.path}" + (f", limit {cap}" if cap is not None else "")
            + f"): {read} rows read, {accepted} accepted, rejects: {reasons}"
            + (" (limit reached)" if limit_reached else "") + f" [{seconds:.1f}s]")

    stats["rejects_by_reason"] = dict(sorted(by_reason.items()))
    stats["rejects_by_source"] = {name: s["rejected"] for name, s in stats["sources"].items()}
    stats["duplicates"] = by_reason.get("duplicate", 0)
    stats["prompts"], stats["longest_prompt"] = total, longest
    if require_any and not total:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) or "no rows at all"
        raise ValueError(f"no prompt accepted from {len(opened)} source(s) "
                         f"({', '.join(op.src.name for op in opened)}); rejects: {reasons}")
