"""Reading a source's local files into records: one reader per file kind, each yielding :class:`Record` and
:class:`Reject` in source order (how each kind is read is documented in :mod:`pipeline.data.sources`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

EXTENSIONS = {
    "jsonl": (".jsonl",),
    "json": (".json",),
    "parquet": (".parquet",),
    "text": (".txt",),
    "sharegpt": (".json", ".jsonl"),
}
HUMAN_ROLES = ("human", "user")
NUL = b"\x00"
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark at the start of a file is dropped


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


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def list_files(root: Path, kind: str) -> Tuple[List[Path], List[Path]]:
    """(files of the kind, other files) under a folder, recursively, sorted, hidden files / folders ignored."""
    keep, other = [], []
    for p in sorted(root.rglob("*"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        (keep if p.name.lower().endswith(EXTENSIONS[kind]) else other).append(p)
    return keep, other


class RowCounter:
    """The next ``source_row`` of a source, across its files."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        n = self.n
        self.n += 1
        return n


def _decoded_lines(path: Path, rows: RowCounter) -> Iterator[Any]:
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


def _as_record(obj: Any, row: int, what: str, path: Path) -> Any:
    """A parsed JSON value as a record; anything but an object is a ``wrong_type`` reject of ``what``."""
    if isinstance(obj, dict):
        return Record(row, obj, str(path))
    return Reject("wrong_type", f"{what} is a JSON {type_name(obj)}, not an object", row, str(path))


def _read_jsonl(path: Path, rows: RowCounter) -> Iterator[Any]:
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
        yield _as_record(obj, row, f"{where}: line", path)


def _read_json(path: Path, rows: RowCounter) -> Iterator[Any]:
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
        yield Reject("wrong_type", f"{path.name}: top-level JSON value is {type_name(obj)}, not an array of "
                     "objects", None, str(path))
        return
    for i, item in enumerate(obj):
        yield _as_record(item, rows.next(), f"{path.name}[{i}]: element", path)


def _read_parquet(path: Path, rows: RowCounter) -> Iterator[Any]:
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


def _read_text_lines(path: Path, rows: RowCounter) -> Iterator[Any]:
    for item in _decoded_lines(path, rows):
        yield item if isinstance(item, Reject) else Record(item[0], {"text": item[2]}, str(path))


def _read_text_file(path: Path, rows: RowCounter) -> Iterator[Any]:
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
        return None, ("wrong_type", f"'conversations' is {type_name(conv)}, not a list")
    for turn in conv:
        if not isinstance(turn, dict):
            return None, ("wrong_type", f"a conversation turn is {type_name(turn)}, not an object")
        role = turn.get("from", turn.get("role"))
        if isinstance(role, str) and role.lower() in HUMAN_ROLES:
            value = turn.get("value", turn.get("content"))
            if value is None:
                return None, ("missing_field", "the first human turn has no 'value'")
            if not isinstance(value, str):
                return None, ("wrong_type", f"the first human turn's value is {type_name(value)}, not a string")
            return {**item, "text": value}, None
    return None, ("missing_field", "no human turn in the conversation")


def read_source_file(path: Path, rows: RowCounter, kind: str, per_file: bool = False) -> Iterator[Any]:
    """The records of one local file of a source of ``kind``; ``per_file``: a text folder, one prompt per file."""
    if kind == "sharegpt":
        reader = _read_jsonl if path.suffix.lower() == ".jsonl" else _read_json
    elif kind == "text":
        reader = _read_text_file if per_file else _read_text_lines
    else:
        reader = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet}[kind]
    return reader(path, rows)
