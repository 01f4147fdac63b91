"""A kind of text of the tiny pair's corpus (:class:`KindSpec`), its documents (:class:`Doc`), the hash split of
those documents, and :class:`KindUnavailable`, what a reader raises when a kind's source is not installed. The
kinds themselves are registered in :mod:`pipeline.tiny.corpus` and read by :mod:`pipeline.tiny.readers`.

Split: a document is held out iff ``int(sha1(key)[:8], 16) % 100 < heldout_percent`` of its kind, with key =
``<kind>/<id>`` (``code`` keeps its historical key, the bare relative path, so ``--kinds code`` rebuilds the
stdlib-only pair exactly). Held-out documents give the held-out loss and the bundled prompts only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable



class KindUnavailable(RuntimeError):
    """A kind's source is not installed; the message names the Debian package that provides it."""

    def __init__(self, kind: str, packages: tuple[str, ...], detail: str):
        self.kind, self.packages, self.detail = kind, packages, detail
        pk = " ".join(packages)
        super().__init__(
            f"kind {kind!r} unavailable: {detail}; it needs the Debian package{'s' if len(packages) > 1 else ''} "
            f"{', '.join(packages)} (as root: apt-get install -y --no-install-recommends {pk})"
        )


@dataclass(frozen=True)
class Doc:
    """One split unit of a kind. ``turns`` (dialogue kinds) are the chat turns ``text`` renders."""

    kind: str
    id: str
    text: str
    turns: tuple = ()

    @property
    def relpath(self) -> str:  # what data.cut_prompts names a prompt's document by
        return self.id


@dataclass(frozen=True)
class KindSpec:
    name: str
    text: str  # what kind of text, in words
    source: str  # where it comes from, in words
    packages: tuple[str, ...]  # Debian packages that provide it (empty: none needed)
    copyright_file: str | None  # where its licence is read from
    licence: str  # the licence, as the copyright file states it
    licence_evidence: str | None  # a phrase of the copyright file that states it (checked at build time)
    heldout_percent: int
    prompt_prefix: str  # prompt ids: "<prefix>/<doc id>#L<a>-L<b>" (maths: "<prefix>/<id>")
    dialogue: bool = False
    reader: Callable[[], list[Doc]] | None = field(default=None, compare=False)

    def split_key(self, doc_id: str) -> str:
        return doc_id if self.name == "code" else f"{self.name}/{doc_id}"

    def is_heldout(self, doc_id: str) -> bool:
        digest = hashlib.sha1(self.split_key(doc_id).encode("utf-8")).hexdigest()
        return int(digest[:8], 16) % 100 < self.heldout_percent


__all__ = ["Doc", "KindSpec", "KindUnavailable"]
