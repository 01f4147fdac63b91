"""The tiny pair's multi-domain corpus: the kinds of text (``KINDS``), loading them, the hash split and the weighted
mix of the training stream. The kinds' readers are in :mod:`pipeline.tiny.readers`, :class:`Doc`, :class:`KindSpec`
and the split rule in :mod:`pipeline.tiny.kinds`, their provenance in :mod:`pipeline.tiny.provenance`.

Kinds (``KINDS``; each a :class:`KindSpec`):

========  =============================================  ==========================  ===========================
kind      text                                           source (Debian package)     split unit (stable id)
========  =============================================  ==========================  ===========================
code      Python code                                    the running interpreter's   file (path under the stdlib)
                                                         stdlib sources
docs      prose with code: the Python documentation       ``python3-doc`` (reST       page (path under _sources)
          as written (reStructuredText)                  ``_sources``; HTML pages
                                                         stripped if only those)
bible     natural language: the King James Bible         ``bible-kjv`` (its          chapter ("Genesis 1")
                                                         ``bible`` program decodes
                                                         ``bible-kjv-text``'s data)
fortunes  natural language: quips, quotes, riddles        ``fortunes`` (+             8 consecutive items of one
          (the fortune(6) cookie files)                  ``fortunes-min``)           file ("computers/0012")
maths     dialogue: generated arithmetic word problems    generated (``maths.py``)    problem ("000123")
          with worked answers, as user/assistant turns
========  =============================================  ==========================  ===========================

A kind whose package is missing raises :class:`KindUnavailable`, whose message names the apt package; the builder
skips it with that message (or stops, if the kind was asked for by name: :func:`load_kinds`).

Split (:func:`split_docs`): a document is held out iff ``int(sha1(key)[:8], 16) % 100 < heldout_percent`` of its
kind (:meth:`KindSpec.is_heldout`, which says which key). Held-out documents give the held-out loss and the bundled
prompts only.

Mix (:func:`mix_documents`): the training stream is documents joined by ``<|endoftext|>``; with more than one kind,
kind k gets ``weight_k / sum(weights)`` of ``total_chars`` characters. Its documents are taken in a seeded order,
repeated whole if the kind is short of its share, the last one cut at a line end so the share is met to within a
line; the taken documents of all kinds are then shuffled together. Weights are shares of characters (tokenizer-free;
the token shares they give are reported by the build). With one kind the stream is that kind's training documents
once, in id order (what the stdlib-only build always did).
"""

from __future__ import annotations

import random
from typing import Callable

from pipeline.tiny import data as tdata
from pipeline.tiny.kinds import Doc, KindSpec, KindUnavailable
from pipeline.tiny.readers import (
    BIBLE_SPEC,
    FORTUNES_DIR,
    read_bible,
    read_code,
    read_docs,
    read_fortunes,
    read_maths,
)
from pipeline.tiny.tokenizer import render_chat

KIND_ORDER = ("code", "docs", "bible", "fortunes", "maths")
# Default shares of the training stream's characters (a judgement, not a measurement). Code stays the largest share
# (HumanEval and the stdlib sets are code); maths, the dialogue kind, is next, since the paper's largest tau
# differences are between maths, code and chat; the docs (prose with code) take a quarter; the bible (very regular,
# archaic prose) and the fortunes (modern and varied, but only 2.3M training characters) share the natural-language
# quarter. At the default 28M characters (20 % of each text kind as chat continuations) every kind is read at most
# about once: code 0.78 passes, docs 0.53, bible 0.84, fortunes 0.97, maths 0.67 of 38k problems.
DEFAULT_WEIGHTS = {"code": 0.30, "docs": 0.25, "bible": 0.15, "fortunes": 0.10, "maths": 0.20}

PY_LICENCE_EVIDENCE = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"
KINDS: dict[str, KindSpec] = {
    "code": KindSpec(
        "code", "Python code", "the running interpreter's standard-library sources (*.py; tests, idlelib, "
        "site-packages, pydoc_data, encodings, turtledemo, ensurepip and test_* files excluded)", (),
        None, "PSF-2.0 (Python Software Foundation License Version 2)", PY_LICENCE_EVIDENCE,
        tdata.HELDOUT_PERCENT, "stdlib", reader=read_code),
    "docs": KindSpec(
        "docs", "prose with code (the Python documentation, reStructuredText as written)",
        "Debian python3-doc: /usr/share/doc/python3.X/html/_sources/**/*.rst.txt", ("python3-doc",),
        "/usr/share/doc/python3-doc/copyright", "PSF-2.0 (Python Software Foundation License Version 2)",
        PY_LICENCE_EVIDENCE, 5, "docs", reader=read_docs),
    "bible": KindSpec(
        "bible", "natural language (the King James Bible, one chapter a document, one verse a line)",
        f"Debian bible-kjv-text, decoded by bible-kjv's `bible -l2000 {BIBLE_SPEC}`", ("bible-kjv", "bible-kjv-text"),
        "/usr/share/doc/bible-kjv-text/copyright",
        "public domain (the KJV text: copyright expired; the package's retrieval software is GPL-2+)",
        "copyright for the King James Version text of the Bible is expired", 5, "bible", reader=read_bible),
    "fortunes": KindSpec(
        "fortunes", "natural language (fortune(6) cookies: quips, quotes, riddles, short stories)",
        f"Debian fortunes + fortunes-min: {FORTUNES_DIR}/* (ascii-art excluded)", ("fortunes", "fortunes-min"),
        "/usr/share/doc/fortunes/copyright",
        "BSD-3-Clause (the Regents of the University of California; the copyright file adds per-file notices)",
        "This program falls under the BSD copyright", 10, "fortunes", reader=read_fortunes),
    "maths": KindSpec(
        "maths", "dialogue: arithmetic word problems with worked answers, as user/assistant chat turns",
        "generated by pipeline/tiny/maths.py (seeded, deterministic; no third-party text)", (), None,
        "generated by this repository (no third-party text)", None, 5, "maths", dialogue=True, reader=read_maths),
}


def parse_kinds(value: str | None) -> list[str] | None:
    """``--kinds``: comma-separated kind names, or None/"all" for every kind."""
    if value is None or value.strip() in ("", "all"):
        return None
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kind(s) {unknown}; choose from {list(KIND_ORDER)}")
    return [k for k in KIND_ORDER if k in kinds]


def parse_weights(value: str | None, kinds: list[str]) -> dict[str, float]:
    """``--weights code=0.3,docs=0.25,...`` over ``kinds`` (missing names take the default), normalised to 1."""
    w = {k: DEFAULT_WEIGHTS[k] for k in kinds}
    if value:
        for part in value.split(","):
            if not part.strip():
                continue
            name, _, num = part.partition("=")
            name = name.strip()
            if name not in KINDS:
                raise ValueError(f"--weights: unknown kind {name!r}")
            if name in w:
                w[name] = float(num)
    if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
        raise ValueError(f"--weights must be >= 0 with a positive sum, got {w}")
    total = sum(w.values())
    return {k: v / total for k, v in w.items()}


def load_kinds(kinds: list[str] | None, log: Callable[[str], None], readers: dict | None = None,
               maths_problems: int = 40_000, seed: int = 0) -> tuple[dict[str, list[Doc]], dict[str, str]]:
    """Read every kind asked for (None: all). Returns ``(docs by kind, skipped kind -> message)``. A missing
    source is logged and skipped when kinds is None; when asked for by name it raises :class:`KindUnavailable`."""
    readers = readers or {}
    out, skipped = {}, {}
    for name in (kinds or list(KIND_ORDER)):
        spec = KINDS[name]
        reader = readers.get(name) or spec.reader
        try:
            docs = reader(n=maths_problems, seed=seed) if name == "maths" and name not in readers else reader()
        except KindUnavailable as err:
            if kinds is not None:
                raise
            log(f"SKIPPED {err}")
            skipped[name] = str(err)
            continue
        out[name] = docs
    if not out:
        raise RuntimeError("no kind of text is available: " + "; ".join(skipped.values()))
    return out, skipped


def split_docs(spec: KindSpec, docs: list[Doc]) -> tuple[list[Doc], list[Doc]]:
    train = [d for d in docs if not spec.is_heldout(d.id)]
    held = [d for d in docs if spec.is_heldout(d.id)]
    return train, held


def _cut_at_line(text: str, n_chars: int) -> str:
    """The longest prefix of ``text`` of at most n_chars characters that ends at a line end (or n_chars chars if
    the first line is longer)."""
    if len(text) <= n_chars:
        return text
    cut = text.rfind("\n", 0, n_chars)
    return text[: cut + 1] if cut > 0 else text[:n_chars]


def take_chars(docs: list[Doc], budget: int, rng: random.Random) -> list[Doc]:
    """Documents in a seeded order (repeated whole when short) until ``budget`` characters; the last one cut."""
    if budget <= 0 or not any(d.text for d in docs):
        return []
    out, have = [], 0
    while have < budget:
        order = list(docs)
        rng.shuffle(order)
        for d in order:
            if have >= budget:
                break
            left = budget - have
            if len(d.text) > left:
                d = Doc(d.kind, d.id + "#part", _cut_at_line(d.text, left), d.turns)
            out.append(d)
            have += len(d.text)
    return out


def chat_continuations(docs: list[Doc], budget: int, rng: random.Random, prefix_chars=(256, 1024),
                       cont_chars=(800, 2000)) -> list[Doc]:
    """Continuation examples in chat form, ``<|user|>{text up to a line end}<|assistant|>{the text after it}
    <|endoftext|>``, cut from ``docs`` until ``budget`` characters: what the target reads when the pipeline puts a
    prompt of this kind through the chat template. Prefix and continuation lengths are drawn uniformly from the
    given character ranges and end at line ends."""
    out, have, j, tries = [], 0, 0, 0
    usable = [d for d in docs if d.text.count("\n") >= 2 and len(d.text.strip().splitlines()) >= 2]
    if not usable or budget <= 0:
        return out
    while have < budget and tries < 100 * (1 + budget // 100):
        tries += 1
        d = usable[rng.randrange(len(usable))]
        lines = d.text.splitlines(keepends=True)
        c = rng.randrange(1, len(lines))
        want_p, want_c = rng.randint(*prefix_chars), rng.randint(*cont_chars)
        s, plen = c, 0
        while s > 0 and plen < want_p:
            s -= 1
            plen += len(lines[s])
        e, clen = c, 0
        while e < len(lines) and clen < want_c:
            clen += len(lines[e])
            e += 1
        user, cont = "".join(lines[s:c]), "".join(lines[c:e])
        if not user.strip() or not cont.strip():
            continue
        text = render_chat([{"role": "user", "content": user}, {"role": "assistant", "content": cont}])
        out.append(Doc(d.kind, f"{d.id}@chat{j}", text))
        have += len(text)
        j += 1
    return out


def mix_documents(train: dict[str, list[Doc]], weights: dict[str, float], total_chars: int, seed: int,
                  chat_frac: float = 0.0) -> tuple[list[Doc], dict[str, dict]]:
    """The training stream's documents (see the module docstring) and per-kind stats (chars, documents, passes).

    ``chat_frac``: the share of each non-dialogue kind's characters spent on :func:`chat_continuations`."""
    kinds = [k for k in KIND_ORDER if k in train]
    if len(kinds) == 1:
        k = kinds[0]
        docs = list(train[k])
        chars = sum(len(d.text) for d in docs)
        return docs, {k: {"chars": chars, "docs": len(docs), "available_chars": chars, "passes": 1.0,
                          "chat_chars": 0, "share": 1.0}}
    out, stats = [], {}
    for k in kinds:
        budget = int(round(weights[k] * total_chars))
        rng = random.Random(f"tiny-mix:{seed}:{k}")
        chat_budget = 0 if KINDS[k].dialogue else int(round(chat_frac * budget))
        plain = take_chars(train[k], budget - chat_budget, rng)
        chat = chat_continuations(train[k], chat_budget, rng) if chat_budget else []
        avail = sum(len(d.text) for d in train[k])
        chars = sum(len(d.text) for d in plain) + sum(len(d.text) for d in chat)
        stats[k] = {"chars": chars, "docs": len(plain) + len(chat), "available_chars": avail,
                    "passes": round(sum(len(d.text) for d in plain) / max(1, avail), 3),
                    "chat_chars": sum(len(d.text) for d in chat)}
        out.extend(plain)
        out.extend(chat)
    random.Random(f"tiny-mix:{seed}").shuffle(out)
    total = sum(s["chars"] for s in stats.values())
    for s in stats.values():
        s["share"] = round(s["chars"] / max(1, total), 4)
    return out, stats


def char_counts(docs: list[Doc]) -> dict:
    return {"docs": len(docs), "chars": sum(len(d.text) for d in docs),
            "bytes": sum(len(d.text.encode("utf-8")) for d in docs)}


__all__ = [
    "DEFAULT_WEIGHTS", "KINDS", "KIND_ORDER", "chat_continuations", "char_counts", "load_kinds", "mix_documents",
    "parse_kinds", "parse_weights", "split_docs", "take_chars",
]
