"""Prompt sources: readers for every source kind and :func:`build_prompts`, shared by ``prepare`` and ``evaluate``.

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

import _string  # the str.format field-name parser (CPython's, used by string.Formatter)
import hashlib
import json
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from pipeline.runtime.config import ConfigError, SourceConfig
from pipeline.data.schemas import prompt_id

REJECT_REASONS = ("empty", "undecodable", "missing_field", "wrong_type", "malformed_json", "nul_bytes", "too_long",
                  "duplicate", "wrong_format")
FILE_KINDS = ("jsonl", "json", "parquet", "text")
EXTENSIONS = {
    "jsonl": (".jsonl",),
    "json": (".json",),
    "parquet": (".parquet",),
    "text": (".txt",),
    "sharegpt": (".json", ".jsonl"),
}
BUNDLED_SPLITS = (None, "label", "eval")
HUMAN_ROLES = ("human", "user")
DETAIL_CHARS = 200
NUL = b"\x00"
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark at the start of a file is dropped


def bundled_split(bundled_id: str) -> str:
    """``"eval"`` for one bundled prompt in ten (by a hash of its id), else ``"label"``; fixed forever."""
    return "eval" if int(hashlib.sha256(str(bundled_id).encode("utf-8")).hexdigest()[:8], 16) % 10 == 0 else "label"


# ---- records -----------------------------------------------------------------------------------------------------


@dataclass
class Reject:
    reason: str
    detail: str
    row: Optional[int] = None  # source_row; None for a file-level reject
    file: Optional[str] = None
    prompt_id: Optional[str] = None


@dataclass
class Record:
    row: int
    fields: Dict[str, Any]
    file: Optional[str] = None


def _short(text: str) -> str:
    text = str(text)
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


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
            _check_template(src.template, f"{key}.template")
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


def _check_template(template: str, key: str) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
        firsts = [(name, _string.formatter_field_name_split(name)[0] if name else "")
                  for _, name, _, _ in parsed if name is not None]
    except ValueError as err:
        raise ConfigError(f"config key '{key}': not a valid str.format template: {err}") from None
    for name, first in firsts:
        if name == "" or isinstance(first, int):
            raise ConfigError(f"config key '{key}': positional fields ('{{}}', '{{0}}') are not allowed; "
                              "name the row's field, e.g. '{question}'")


# ---- text extraction ---------------------------------------------------------------------------------------------


class _FieldProblem(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _RowFormatter(string.Formatter):
    """str.format over a row that reports missing keys / wrong types instead of formatting garbage."""

    def get_field(self, field_name, args, kwargs):
        first, rest = _string.formatter_field_name_split(field_name)
        if first not in kwargs:
            raise _FieldProblem("missing_field", f"template key {first!r} not in the row")
        obj, path = kwargs[first], str(first)
        for is_attr, key in rest:
            if obj is None:
                raise _FieldProblem("missing_field", f"template field {path!r} is null")
            if isinstance(obj, (str, bytes)):
                raise _FieldProblem("wrong_type", f"template indexes into {path!r}, a string")
            try:
                obj = getattr(obj, key) if is_attr else obj[key]
            except (KeyError, IndexError):
                raise _FieldProblem("missing_field", f"template field {path}[{key!r}] is absent") from None
            except (TypeError, AttributeError):
                raise _FieldProblem("wrong_type", f"template field {path!r} ({_type_name(obj)}) has no "
                                    f"{'attribute' if is_attr else 'item'} {key!r}") from None
            path += f".{key}" if is_attr else f"[{key!r}]"
        return obj, first

    def format_field(self, value, format_spec):
        if value is None:
            raise _FieldProblem("missing_field", "a template field is null")
        if isinstance(value, (dict, list, tuple, bytes, bytearray)):
            raise _FieldProblem("wrong_type", f"a template field is a {_type_name(value)}, not a scalar")
        return super().format_field(value, format_spec)


_FORMATTER = _RowFormatter()


def row_text(src: SourceConfig, fields: Dict[str, Any], default_field: Optional[str] = None) -> Tuple[Optional[str], Optional[Tuple[str, str]]]:
    """The prompt text of one row: the template, else the field. Returns (text, None) or (None, (reason, detail))."""
    if src.template is not None:
        try:
            text = _FORMATTER.vformat(src.template, (), fields)
        except _FieldProblem as p:
            return None, (p.reason, p.detail)
        except (ValueError, TypeError) as err:  # e.g. a format spec that does not fit the value
            return None, ("wrong_type", f"template does not apply: {err}")
    else:
        name = default_field or src.field
        if name is None:
            return None, ("missing_field", "source has neither `field` nor `template`")
        if name not in fields:
            return None, ("missing_field", f"field {name!r} not in the row (has {', '.join(map(str, list(fields)[:8]))})")
        text = fields[name]
        if text is None:
            return None, ("missing_field", f"field {name!r} is null")
        if not isinstance(text, str):
            return None, ("wrong_type", f"field {name!r} is {_type_name(text)}, not a string")
    return text, None


def text_problem(text: str) -> Optional[Tuple[str, str]]:
    """``undecodable`` (lone surrogates), ``nul_bytes`` or ``empty``; None when the text is usable."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return "undecodable", (f"lone surrogate U+{ord(text[err.start]):04X} at character {err.start} (an invalid "
                               "UTF-8 byte or an unpaired \\u escape)")
    if "\x00" in text:
        return "nul_bytes", f"NUL character at position {text.index(chr(0))}"
    if not text.strip():
        return "empty", "empty prompt" if not text else "whitespace-only prompt"
    return None


# ---- readers -----------------------------------------------------------------------------------------------------


def _list_files(root: Path, kind: str) -> Tuple[List[Path], List[Path]]:
    """(files of the kind, other files) under a folder, recursively, sorted, hidden files / folders ignored."""
    keep, other = [], []
    for p in sorted(root.rglob("*"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        (keep if p.name.lower().endswith(EXTENSIONS[kind]) else other).append(p)
    return keep, other


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        n = self.n
        self.n += 1
        return n


def _decoded_lines(path: Path, rows: _Counter) -> Iterator[Any]:
    """Non-blank lines of a line-oriented file, decoded one by one so a bad line rejects only itself: yields
    (row, where, text) or a Reject (NUL byte, invalid UTF-8). Strips a leading BOM and CR/LF endings."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.rstrip(b"\r\n")
            if lineno == 1 and line.startswith(BOM):
                line = line[len(BOM):]
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            row = rows.next()
            if NUL in line:
                yield Reject("nul_bytes", f"{where}: NUL byte in the line", row, str(path))
                continue
            try:
                yield row, where, line.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Reject("undecodable", f"{where}: invalid UTF-8 at byte {err.start}", row, str(path))


def _read_jsonl(path: Path, rows: _Counter) -> Iterator[Any]:
    for item in _decoded_lines(path, rows):
        if isinstance(item, Reject):
            yield item
            continue
        row, where, decoded = item
        try:
            obj = json.loads(decoded)
        except json.JSONDecodeError as err:
            yield Reject("malformed_json", f"{where}: {err.msg} at column {err.colno}", row, str(path))
            continue
        if not isinstance(obj, dict):
            yield Reject("wrong_type", f"{where}: line is a JSON {_type_name(obj)}, not an object", row,
                         str(path))
            continue
        yield Record(row, obj, str(path))


def _read_json(path: Path, rows: _Counter) -> Iterator[Any]:
    raw = path.read_bytes()
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    # surrogateescape: invalid bytes inside a string become lone surrogates and reject only that row.
    try:
        obj = json.loads(raw.decode("utf-8", errors="surrogateescape"))
    except json.JSONDecodeError as err:
        yield Reject("malformed_json", f"{path.name}: {err.msg} at line {err.lineno} column {err.colno}", None,
                     str(path))
        return
    if not isinstance(obj, list):
        yield Reject("wrong_type", f"{path.name}: top-level JSON value is {_type_name(obj)}, not an array of "
                     "objects", None, str(path))
        return
    for i, item in enumerate(obj):
        row = rows.next()
        if not isinstance(item, dict):
            yield Reject("wrong_type", f"{path.name}[{i}]: element is a JSON {_type_name(item)}, not an object", row,
                         str(path))
            continue
        yield Record(row, item, str(path))


def _read_parquet(path: Path, rows: _Counter) -> Iterator[Any]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is one file-level reject
        yield Reject("wrong_format", f"{path.name}: not a readable parquet file ({type(err).__name__})", None,
                     str(path))
        return
    for batch in pf.iter_batches(batch_size=1024):
        for item in batch.to_pylist():
            yield Record(rows.next(), item, str(path))


def _read_text_lines(path: Path, rows: _Counter) -> Iterator[Any]:
    for item in _decoded_lines(path, rows):
        yield item if isinstance(item, Reject) else Record(item[0], {"text": item[2]}, str(path))


def _read_text_file(path: Path, rows: _Counter) -> Iterator[Any]:
    raw = path.read_bytes().rstrip(b"\r\n")
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    row = rows.next()
    if NUL in raw:
        yield Reject("nul_bytes", f"{path.name}: NUL byte at byte {raw.index(NUL)}", row, str(path))
        return
    try:
        yield Record(row, {"text": raw.decode("utf-8")}, str(path))
    except UnicodeDecodeError as err:
        yield Reject("undecodable", f"{path.name}: invalid UTF-8 at byte {err.start}", row, str(path))


def sharegpt_fields(item: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], Optional[Tuple[str, str]]]:
    """The row's fields plus ``text`` = its first human turn, or (None, (reason, detail))."""
    conv = item.get("conversations", item.get("messages")) if isinstance(item, dict) else None
    if conv is None:
        return None, ("missing_field", "no 'conversations' in the row")
    if not isinstance(conv, (list, tuple)):
        return None, ("wrong_type", f"'conversations' is {_type_name(conv)}, not a list")
    for turn in conv:
        if not isinstance(turn, dict):
            return None, ("wrong_type", f"a conversation turn is {_type_name(turn)}, not an object")
        role = turn.get("from", turn.get("role"))
        if isinstance(role, str) and role.lower() in HUMAN_ROLES:
            value = turn.get("value", turn.get("content"))
            if value is None:
                return None, ("missing_field", "the first human turn has no 'value'")
            if not isinstance(value, str):
                return None, ("wrong_type", f"the first human turn's value is {_type_name(value)}, not a string")
            return {**item, "text": value}, None
    return None, ("missing_field", "no human turn in the conversation")


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


def _file_records(src: SourceConfig, opened: _Opened, reader_for: Callable[[Path], Callable]) -> None:
    root = _local(src.path)
    if root.is_dir():
        files, other = _list_files(root, src.kind)
    else:
        files, other = [root], []
    opened.files = [str(p) for p in files]

    def gen():
        rows = _Counter()
        for p in other:
            yield Reject("wrong_format", f"{p.relative_to(root).as_posix()}: not a {'/'.join(EXTENSIONS[src.kind])} "
                         f"file (kind {src.kind}); skipped", None, str(p))
        for p in files:
            n_items = 0
            for item in reader_for(p)(p, rows):
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
            _file_records(src, opened, lambda p: _read_jsonl if p.suffix.lower() == ".jsonl" else _read_json)
        else:
            opened.records = _hf_records(_load_hf(src))
    elif src.kind == "text":
        opened.default_field = "text"
        per_file = _local(src.path).is_dir()
        _file_records(src, opened, lambda p: _read_text_file if per_file else _read_text_lines)
    elif src.kind in ("jsonl", "json", "parquet"):
        reader = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet}[src.kind]
        _file_records(src, opened, lambda p: reader)
    else:  # validate_sources catches this first
        raise ConfigError(f"source {src.name!r}: unknown kind {src.kind!r}")
    return opened


# ---- build_prompts -----------------------------------------------------------------------------------------------


def effective_limit(src: SourceConfig, limit: Optional[int]) -> Optional[int]:
    caps = [c for c in (limit, src.limit) if c is not None]
    return min(caps) if caps else None


def _reject_dict(src_name: str, r: Reject) -> Dict[str, Any]:
    return {"source": src_name, "source_row": r.row, "prompt_id": r.prompt_id, "reason": r.reason,
            "detail": _short(r.detail), "file": r.file}


def build_prompts(sources: Sequence[SourceConfig], tokenizer, max_prompt_tokens: int,
                  apply_chat_template: bool = True, enable_thinking: bool = False, limit: Optional[int] = None, *,
                  section: str = "prepare", log: Optional[Callable[[str], None]] = None,
                  require_any: bool = True) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], Dict[str, Any]]:
    """Read every source and build the prompt rows.

    Returns ``(rows, rejects, stats)``: ``rows`` are dicts with exactly the columns of
    ``pipeline.data.schemas.PROMPTS_SCHEMA`` (sources in the given order, rows in source order); ``rejects`` are dicts
    ``{source, source_row, prompt_id, reason, detail, file}``; ``stats`` holds per-source counts
    (``read``, ``accepted``, ``rejected``, ``duplicates``, ``rejects_by_reason``, ``limit``, ``limit_reached``,
    ``files``, ``empty_files``), ``rejects_by_reason``, ``rejects_by_source``, ``duplicates`` and ``notes``.

    Every source is validated and opened before any row is read. ``limit`` caps the ACCEPTED prompts of each
    source (a source's own ``limit`` wins when smaller). Raises ``ValueError`` when nothing is accepted and
    ``require_any``.
    """
    from pipeline.data.chat import format_prompt

    log = log or (lambda msg: None)
    validate_sources(sources, section)
    opened = [open_source(src) for src in sources]

    rows: List[Dict[str, Any]] = []
    rejects: List[Dict[str, Any]] = []
    seen: set = set()
    by_reason: Counter = Counter()
    stats: Dict[str, Any] = {"sources": {}, "notes": []}

    for op in opened:
        src = op.src
        t0 = time.time()
        cap = effective_limit(src, limit)
        s_reasons: Counter = Counter()
        read = accepted = 0
        log(f"source {src.name!r}: kind {src.kind}, path {src.path}"
            + (f", limit {cap}" if cap is not None else ""))

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
            if pid in seen:
                reject(Reject("duplicate", "same prompt_id as an earlier prompt", rec.row, rec.file, pid))
                continue
            seen.add(pid)
            prompt = format_prompt(tokenizer, text, apply_chat_template, enable_thinking)
            ids = list(tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"])
            if len(ids) > max_prompt_tokens:
                reject(Reject("too_long", f"{len(ids)} tokens > max_prompt_tokens {max_prompt_tokens}", rec.row,
                              rec.file, pid))
                continue
            rows.append({"prompt_id": pid, "source": src.name, "source_row": int(rec.row), "text": text,
                         "prompt": prompt, "input_ids": ids, "prompt_tokens": len(ids)})
            accepted += 1

        by_reason.update(s_reasons)
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
        log(f"source {src.name!r}: {read} rows read, {accepted} accepted, rejects: {reasons}"
            + (" (limit reached)" if limit_reached else "") + f" [{time.time() - t0:.1f}s]")

    stats["rejects_by_reason"] = dict(sorted(by_reason.items()))
    stats["rejects_by_source"] = {name: s["rejected"] for name, s in stats["sources"].items()}
    stats["duplicates"] = by_reason.get("duplicate", 0)
    if require_any and not rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) or "no rows at all"
        raise ValueError(f"no prompt accepted from {len(sources)} source(s) "
                         f"({', '.join(s.name for s in sources)}); rejects: {reasons}")
    return rows, rejects, stats
