"""The tiny pair's multi-domain corpus: the kinds of text, their readers, their provenance, the hash split and the
weighted mix of the training stream.

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
skips it with that message (or stops, if the kind was asked for by name).

Split: a document is held out iff ``int(sha1(key)[:8], 16) % 100 < heldout_percent`` of its kind, with key =
``<kind>/<id>`` (``code`` keeps its historical key, the bare relative path, so ``--kinds code`` rebuilds the
stdlib-only pair exactly). Held-out documents give the held-out loss and the bundled prompts only.

Mix (:func:`mix_documents`): the training stream is documents joined by ``<|endoftext|>``; with more than one kind,
kind k gets ``weight_k / sum(weights)`` of ``total_chars`` characters. Its documents are taken in a seeded order,
repeated whole if the kind is short of its share, the last one cut at a line end so the share is met to within a
line; the taken documents of all kinds are then shuffled together. Weights are shares of characters (tokenizer-free;
the token shares they give are reported by the build). With one kind the stream is that kind's training documents
once, in id order (what the stdlib-only build always did).
"""

from __future__ import annotations

import glob
import hashlib
import html.parser
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.tiny import data as tdata
from pipeline.tiny import maths
from pipeline.tiny.tokenizer import render_chat

KIND_ORDER = ("code", "docs", "bible", "fortunes", "maths")
# Default shares of the training stream's characters (a judgement, not a measurement). Code stays the largest share
# (HumanEval and the stdlib sets are code); maths, the dialogue kind, is next, since the paper's largest tau
# differences are between maths, code and chat; the docs (prose with code) take a quarter; the bible (very regular,
# archaic prose) and the fortunes (modern and varied, but only 2.3M training characters) share the natural-language
# quarter. At the default 28M characters (20 % of each text kind as chat continuations) every kind is read at most
# about once: code 0.78 passes, docs 0.53, bible 0.84, fortunes 0.97, maths 0.67 of 38k problems.
DEFAULT_WEIGHTS = {"code": 0.30, "docs": 0.25, "bible": 0.15, "fortunes": 0.10, "maths": 0.20}
FORTUNE_CHUNK = 8  # fortune items per document
BIBLE_SPEC = "Gen1:1-Rev22:21"


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


# ---- readers -----------------------------------------------------------------------------------------------------


def read_code(root: Path | None = None) -> list[Doc]:
    return [Doc("code", f.relpath, f.text) for f in tdata.collect_sources(root)]


def python_doc_root() -> Path | None:
    """The HTML folder python3-doc installs (``/usr/share/doc/python3-doc/html`` -> ``../python3.X/html``)."""
    for cand in ["/usr/share/doc/python3-doc/html", *sorted(glob.glob("/usr/share/doc/python3*/html"))]:
        p = Path(cand)
        if p.is_dir():
            return p.resolve()
    return None


class _HTMLText(html.parser.HTMLParser):
    """The visible text of a Sphinx page's main body (scripts, styles, sidebars dropped; <pre> kept verbatim)."""

    SKIP = {"script", "style", "head", "nav"}
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
    BLOCK = {"p", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "br", "pre",
             "table", "ul", "ol", "dl", "blockquote"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, main body)

    def _state(self) -> tuple[bool, bool, bool]:
        skip = any(s for _, s, _ in self.stack)
        body = any(b for _, _, b in self.stack)
        pre = any(t == "pre" for t, _, _ in self.stack)
        return skip, body, pre

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in self.BLOCK:
            self.out.append("\n")
        if tag in self.VOID:
            return
        skipped = tag in self.SKIP or (tag == "div" and "sphinxsidebar" in (a.get("class") or ""))
        self.stack.append((tag, skipped, tag == "div" and a.get("role") == "main"))

    def handle_endtag(self, tag):
        if tag in self.BLOCK:
            self.out.append("\n")
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        skip, body, pre = self._state()
        if skip or not body:
            return
        self.out.append(data if pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        lines = [ln.rstrip() for ln in "".join(self.out).splitlines()]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def html_to_text(page: str) -> str:
    p = _HTMLText()
    p.feed(page)
    p.close()
    return p.text()


def read_docs(root: Path | None = None) -> list[Doc]:
    """The Python documentation: the reST sources (``_sources/**/*.rst.txt``) where shipped, else the HTML pages
    with the markup stripped (stdlib ``html.parser``)."""
    root = python_doc_root() if root is None else Path(root)
    if root is None or not root.is_dir():
        raise KindUnavailable("docs", ("python3-doc",), "no /usr/share/doc/python3*/html folder")
    src = root / "_sources"
    docs = []
    if src.is_dir():
        for path in sorted(src.rglob("*.rst.txt")):
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip() and len(text) <= tdata.MAX_FILE_BYTES:
                docs.append(Doc("docs", path.relative_to(src).as_posix()[: -len(".txt")], text))
    else:
        for path in sorted(root.rglob("*.html")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("_") or rel in ("genindex.html", "search.html", "py-modindex.html") or \
                    rel.startswith("genindex-"):
                continue
            text = html_to_text(path.read_text(encoding="utf-8", errors="replace"))
            if text.strip() and len(text) <= tdata.MAX_FILE_BYTES:
                docs.append(Doc("docs", rel, text))
    if not docs:
        raise KindUnavailable("docs", ("python3-doc",), f"no documentation pages under {root}")
    return docs


_BIBLE_HEAD = re.compile(r"^(\S.*\S) (\d+)$")
_BIBLE_VERSE = re.compile(r"^\s+(\d+) (.*)$")


def parse_bible(raw: str) -> list[Doc]:
    """``bible -l2000 Gen1:1-Rev22:21`` output -> one document per chapter: the heading, a blank line, then one
    verse per line (``<n> <text>``)."""
    docs, head, verses = [], None, []

    def flush():
        if head is not None and verses:
            docs.append(Doc("bible", head, head + "\n\n" + "\n".join(verses) + "\n"))

    for line in raw.splitlines():
        if not line.strip():
            continue
        m = _BIBLE_VERSE.match(line)
        if m and head is not None:
            verses.append(f"{m.group(1)} {m.group(2).strip()}")
            continue
        if _BIBLE_HEAD.match(line.strip()):
            flush()
            head, verses = line.strip(), []
        elif verses:  # a wrapped verse line (not with -l2000, but be safe)
            verses[-1] += " " + line.strip()
    flush()
    return docs


def read_bible() -> list[Doc]:
    exe = shutil.which("bible")
    if exe is None:
        have_text = Path("/usr/lib/bible.data").exists()
        raise KindUnavailable(
            "bible", ("bible-kjv",) if have_text else ("bible-kjv", "bible-kjv-text"),
            "the `bible` program (which decodes bible-kjv-text's compressed /usr/lib/bible.data) is not installed",
        )
    res = subprocess.run([exe, "-l2000", BIBLE_SPEC], capture_output=True, text=True, encoding="utf-8",
                         errors="replace", timeout=120, stdin=subprocess.DEVNULL, check=False)
    docs = parse_bible(res.stdout)
    if res.returncode != 0 or len(docs) < 1000:
        raise KindUnavailable("bible", ("bible-kjv", "bible-kjv-text"),
                              f"`bible {BIBLE_SPEC}` gave {len(docs)} chapters (rc {res.returncode}: "
                              f"{res.stderr.strip()[:200]})")
    return docs


FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNES_EXCLUDED = frozenset({"ascii-art"})  # drawings, not text


def split_fortunes(raw: str) -> list[str]:
    """A cookie file's items: the text between lines that are exactly ``%``."""
    items, cur = [], []
    for line in raw.splitlines():
        if line == "%":
            if "".join(cur).strip():
                items.append("\n".join(cur).strip("\n"))
            cur = []
        else:
            cur.append(line.rstrip())
    if "".join(cur).strip():
        items.append("\n".join(cur).strip("\n"))
    return items


def read_fortunes(root: Path | None = None) -> list[Doc]:
    """One document per FORTUNE_CHUNK consecutive items of a cookie file, in the file's own format (items separated
    by ``%`` lines); id ``<file>/<chunk index>``."""
    root = FORTUNES_DIR if root is None else Path(root)
    if not root.is_dir():
        raise KindUnavailable("fortunes", ("fortunes",), f"no {root} folder")
    docs = []
    for path in sorted(root.iterdir()):
        if path.is_symlink() or not path.is_file() or path.suffix in (".dat", ".u8") or path.name.startswith("."):
            continue
        if path.name in FORTUNES_EXCLUDED:
            continue
        items = split_fortunes(path.read_text(encoding="utf-8", errors="replace"))
        for ci in range(0, len(items), FORTUNE_CHUNK):
            chunk = items[ci: ci + FORTUNE_CHUNK]
            docs.append(Doc("fortunes", f"{path.name}/{ci // FORTUNE_CHUNK:04d}", "\n%\n".join(chunk) + "\n"))
    if not docs:
        raise KindUnavailable("fortunes", ("fortunes",), f"no cookie files in {root}")
    return docs


def read_maths(n: int = 40_000, seed: int = 0) -> list[Doc]:
    """Problems 0 .. n-1 (generated; nothing to install)."""
    docs = []
    for i in range(n):
        turns = maths.problem(i, seed)
        docs.append(Doc("maths", maths.problem_id(i), render_chat(turns), tuple(
            (t["role"], t["content"]) for t in turns)))
    return docs


def doc_turns(doc: Doc) -> list[dict]:
    return [{"role": r, "content": c} for r, c in doc.turns]


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


# ---- provenance --------------------------------------------------------------------------------------------------


def dpkg_version(package: str) -> str | None:
    exe = shutil.which("dpkg-query")
    if exe is None:
        return None
    res = subprocess.run([exe, "-W", "-f=${Status}\t${Version}", package], capture_output=True, text=True,
                         check=False)
    if res.returncode != 0 or "\t" not in res.stdout:
        return None
    status, version = res.stdout.split("\t", 1)
    return version.strip() if status.strip().endswith("installed") and "not-installed" not in status else None


def provenance(spec: KindSpec) -> dict:
    """Source, packages with versions (dpkg-query), the licence and where it was read (with the evidence)."""
    packages = [{"name": p, "version": dpkg_version(p)} for p in spec.packages]
    if spec.name == "docs":  # python3-doc is a metapackage; python3.X-doc ships the files
        for name in sorted({m.group(0) for m in re.finditer(r"python3\.\d+-doc", _dpkg_depends("python3-doc"))}):
            packages.append({"name": name, "version": dpkg_version(name)})
    copyright_file = spec.copyright_file
    if spec.name == "code":
        copyright_file = str(tdata.stdlib_root() / "LICENSE.txt")
        packages = [{"name": f"python{sys.version_info[0]}.{sys.version_info[1]} (the building interpreter, "
                             f"{sys.base_prefix})", "version": ".".join(map(str, sys.version_info[:3]))}]
    found = None
    sha = None
    if copyright_file and Path(copyright_file).is_file():
        raw = Path(copyright_file).read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        found = spec.licence_evidence is not None and spec.licence_evidence in raw.decode("utf-8", "replace")
    licence = spec.licence if (found or spec.licence_evidence is None) else \
        f"UNVERIFIED ({spec.licence}; the evidence phrase was not found in {copyright_file})"
    return {"kind": spec.name, "text": spec.text, "source": spec.source, "packages": packages,
            "licence": licence, "copyright_file": copyright_file, "copyright_sha256": sha,
            "licence_evidence": spec.licence_evidence, "licence_verified": bool(found)}


def _dpkg_depends(package: str) -> str:
    exe = shutil.which("dpkg-query")
    if exe is None:
        return ""
    res = subprocess.run([exe, "-W", "-f=${Depends}", package], capture_output=True, text=True, check=False)
    return res.stdout if res.returncode == 0 else ""


# ---- loading, splitting, mixing ----------------------------------------------------------------------------------


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
    "DEFAULT_WEIGHTS", "KINDS", "KIND_ORDER", "Doc", "KindSpec", "KindUnavailable", "chat_continuations",
    "char_counts", "load_kinds", "mix_documents", "parse_kinds", "parse_weights", "provenance", "read_bible",
    "read_code", "read_docs", "read_fortunes", "read_maths", "split_docs", "take_chars",
]
