"""The code kind of the tiny pair's corpus (the other kinds: :mod:`pipeline.tiny.corpus`): the Python
standard-library sources of the running interpreter, split deterministically into training and held-out files;
and the line-boundary prompt cutter every text kind shares.

The split depends only on each file's path relative to the stdlib root (a SHA-1 of it), so it
is stable across machines; the corpus itself is whatever stdlib the building interpreter has
(the committed artefacts record which one).
"""

from __future__ import annotations

import hashlib
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories (any path component) left out of the corpus: tests, bundled third-party code,
# IDLE, generated data tables (pydoc topics, codec maps) and build configuration.
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "pydoc_data",
        "encodings",
        "__pycache__",
        "lib-dynload",
        "ensurepip",
        "turtledemo",
    }
)
HELDOUT_PERCENT = 5  # files whose path hash falls in the first 5 of 100 buckets
MAX_FILE_BYTES = 400_000  # skip pathological giants (none in a normal stdlib)


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    parts = rel.parts
    if any(p in EXCLUDED_DIRS for p in parts[:-1]):
        return True
    if parts[0].startswith("config-"):
        return True
    name = parts[-1]
    return (
        name.startswith("test_")
        or name.endswith("_test.py")
        or name.startswith("_sysconfigdata")
        or name == "__phello__"
    )


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha1(relpath.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < HELDOUT_PERCENT


def collect_sources(root: Path | None = None) -> list[SourceFile]:
    """All corpus files, sorted by relative path (POSIX separators)."""
    root = stdlib_root() if root is None else Path(root)
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _excluded(rel) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        files.append(SourceFile(rel.as_posix(), text))
    return files


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.relpath)]
    heldout = [f for f in files if is_heldout(f.relpath)]
    return train, heldout


def corpus_description(files: list[SourceFile]) -> str:
    return (
        f"Python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro} "
        f"stdlib, {len(files)} files, {sum(len(f.text) for f in files):,} characters"
    )


def cut_prompts(
    files: list[SourceFile],
    count_tokens,
    n: int,
    seed: int,
    min_tokens: int = 64,
    max_tokens: int = 256,
    prefix: str = "stdlib",
) -> list[dict]:
    """Cut `n` code-prefix prompts from `files`, at line boundaries.

    Each prompt ends at the end of a line that is followed by more non-blank code in the file
    (so there is something to continue); its start is moved back line by line until the prompt
    has at least a target number of tokens drawn uniformly from [min_tokens, max_tokens]
    (never more than max_tokens). Candidates are visited in a seeded random order; prompts
    that cannot reach min_tokens are skipped. The returned order is that random order, so any
    prefix of the list is a random sample. Ids are ``<prefix>/<relpath>#L<first>-L<last>``; any object with
    ``relpath`` and ``text`` will do as a file (``corpus.Doc`` too).
    """
    rng = random.Random(seed)
    candidates = []
    for fi, f in enumerate(files):
        lines = f.text.splitlines(keepends=True)
        for end in range(8, len(lines) - 1):  # prompt = lines[start:end]
            if lines[end].strip():
                candidates.append((fi, end))
    rng.shuffle(candidates)
    prompts: list[dict] = []
    seen: set[tuple[int, int]] = set()
    for fi, end in candidates:
        if len(prompts) >= n:
            break
        if (fi, end) in seen:
            continue
        lines = files[fi].text.splitlines(keepends=True)
        target = rng.randint(min_tokens, max_tokens)
        start = end
        text = ""
        ntok = 0
        while start > 0:
            cand = "".join(lines[start - 1 : end])
            cnt = count_tokens(cand)
            if cnt > max_tokens:
                break
            start, text, ntok = start - 1, cand, cnt
            if ntok >= target:
                break
        if ntok < min_tokens or not text.strip():
            continue
        seen.add((fi, end))
        prompts.append(
            {
                "id": f"{prefix}/{files[fi].relpath}#L{start + 1}-L{end}",
                "text": text,
                "num_tokens": ntok,
            }
        )
    return prompts
