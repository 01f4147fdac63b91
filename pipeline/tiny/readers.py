"""The readers of the tiny pair's corpus, one per kind of text (:data:`pipeline.tiny.corpus.KINDS` names them):
each returns the kind's split units as :class:`~pipeline.tiny.kinds.Doc`, in a fixed order.

- code: the running interpreter's stdlib sources (:func:`pipeline.tiny.data.collect_sources`), one file a document;
- docs: the Python documentation of ``python3-doc``, the reST ``_sources`` as written, or (if only the HTML pages
  are shipped) the pages' main text with the markup stripped by the stdlib ``html.parser``; one page a document;
- bible: the King James Bible, decoded by ``bible-kjv``'s ``bible`` program from ``bible-kjv-text``'s data; one
  chapter ("Genesis 1") a document, one verse a line;
- fortunes: the fortune(6) cookie files of ``fortunes`` (+ ``fortunes-min``), ``FORTUNE_CHUNK`` consecutive items
  of one file a document ("computers/0012");
- maths: generated arithmetic word problems with worked answers (:mod:`pipeline.tiny.maths`) as user/assistant
  turns; one problem ("000123") a document; nothing to install.

A kind whose package is missing raises :class:`~pipeline.tiny.kinds.KindUnavailable`, whose message names the apt
package; the builder skips it with that message (or stops, if the kind was asked for by name).
"""

from __future__ import annotations

import glob
import html.parser
import re
import shutil
import subprocess
from pathlib import Path

from pipeline.tiny import data as tdata
from pipeline.tiny import maths
from pipeline.tiny.kinds import Doc, KindUnavailable
from pipeline.tiny.tokenizer import render_chat

FORTUNE_CHUNK = 8  # fortune items per document
BIBLE_SPEC = "Gen1:1-Rev22:21"


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


__all__ = [
    "BIBLE_SPEC", "FORTUNES_DIR", "FORTUNES_EXCLUDED", "FORTUNE_CHUNK", "doc_turns", "html_to_text", "parse_bible",
    "python_doc_root", "read_bible", "read_code", "read_docs", "read_fortunes", "read_maths", "split_fortunes",
]
