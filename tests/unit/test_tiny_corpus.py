"""The tiny pair's multi-domain corpus (pipeline/tiny/corpus.py, kinds.py, readers.py, provenance.py, maths.py,
prompts.py): the readers on small real inputs (the installed Debian packages where present, skipped with the
package to install where not; the generated maths always), the hash split, the mix weights, the per-kind prompt
sets, the provenance and the message of a missing package. No model is trained; seconds."""

from __future__ import annotations

import random
import re
import shutil

import pytest

from pipeline.tiny import corpus as C
from pipeline.tiny import maths
from pipeline.tiny import prompts as P
from pipeline.tiny import readers as R
from pipeline.tiny.kinds import Doc, KindUnavailable
from pipeline.tiny.provenance import dpkg_version, provenance
from pipeline.tiny.tokenizer import ASSISTANT, EOS, USER, render_chat


def _docs(kind: str, n: int, size: int = 200, seed: int = 0) -> list[Doc]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        lines = [f"{kind} doc {i} line {j} " + "x" * r.randint(5, 40) for j in range(max(3, size // 30))]
        out.append(Doc(kind, f"d{i:04d}", "\n".join(lines) + "\n"))
    return out


# ---- readers ----------------------------------------------------------------------------------------------------


def test_code_reader_on_a_small_tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (tmp_path / "pkg" / "test_mod.py").write_text("assert True\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "x.py").write_text("x = 1\n")
    (tmp_path / "top.py").write_text("import os\n")
    docs = R.read_code(tmp_path)
    assert [d.id for d in docs] == ["pkg/mod.py", "top.py"]
    assert all(d.kind == "code" for d in docs)


def test_docs_reader_on_the_installed_python_documentation():
    root = R.python_doc_root()
    if root is None or not (root / "_sources").is_dir():
        pytest.skip("the Python documentation is not installed: apt-get install -y python3-doc")
    docs = R.read_docs(root)
    ids = {d.id for d in docs}
    assert len(docs) > 100 and "library/bisect.rst" in ids
    page = next(d for d in docs if d.id == "library/bisect.rst")
    assert "bisect" in page.text and ".. function::" in page.text  # prose with code, as written


def test_html_is_stripped_to_its_main_text():
    page = ("<html><head><title>T</title><script>var x = 1;</script></head><body>"
            "<div class='sphinxsidebar'>nav stuff</div><div role='main'><h1>Title</h1>"
            "<p>Some <em>prose</em> &amp; text.</p><pre>def f():\n    return 1\n</pre></div></body></html>")
    text = R.html_to_text(page)
    assert "Title" in text and "Some prose & text." in text
    assert "def f():\n    return 1" in text  # <pre> kept verbatim
    assert "var x" not in text and "nav stuff" not in text


def test_bible_parser_on_a_small_input():
    raw = "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n  2 And the earth was\n" \
          "without form.\n\n1 Samuel 2\n\n  1 And Hannah prayed.\n"
    docs = R.parse_bible(raw)
    assert [d.id for d in docs] == ["Genesis 1", "1 Samuel 2"]
    assert docs[0].text == ("Genesis 1\n\n1 In the beginning God created the heaven and the earth.\n"
                            "2 And the earth was without form.\n")


def test_bible_reader_on_the_installed_bible():
    if shutil.which("bible") is None:
        pytest.skip("the KJV bible is not installed: apt-get install -y bible-kjv (it pulls in bible-kjv-text)")
    docs = R.read_bible()
    assert len(docs) == 1189 and docs[0].id == "Genesis 1" and docs[-1].id == "Revelation 22"
    assert docs[0].text.startswith("Genesis 1\n\n1 In the beginning God created the heaven and the earth.\n")


def test_fortunes_reader_on_a_small_tree(tmp_path):
    (tmp_path / "jokes").write_text("one\n%\ntwo\nlines\n%\n%\nthree\n")
    (tmp_path / "jokes.dat").write_bytes(b"\x00\x01")
    (tmp_path / "jokes.u8").symlink_to("jokes")
    (tmp_path / "ascii-art").write_text("/\\_/\\\n%\n")
    docs = R.read_fortunes(tmp_path)
    assert [d.id for d in docs] == ["jokes/0000"]
    assert docs[0].text == "one\n%\ntwo\nlines\n%\nthree\n"
    assert R.split_fortunes("a\n%\n\n%\nb\n") == ["a", "b"]


def test_fortunes_reader_on_the_installed_cookies():
    if not R.FORTUNES_DIR.is_dir():
        pytest.skip("the fortune cookies are not installed: apt-get install -y fortunes")
    docs = R.read_fortunes()
    assert len(docs) > 100
    assert all(re.fullmatch(r"[\w.-]+/\d{4}", d.id) for d in docs)
    assert len({d.id for d in docs}) == len(docs)


def test_maths_is_generated_deterministically_with_correct_worked_answers():
    assert maths.problem(7) == maths.problem(7) and maths.problem(7) != maths.problem(8)
    assert maths.problem(7, seed=1) != maths.problem(7, seed=0)
    chain = re.compile(r"[\d(][\d+\-*/() ]*(?: = [\d(][\d+\-*/() ]*)+")  # "7 * 12 = 84", "2 * (3 + 4) = 2 * 7 = 14"
    checked, followups = 0, 0
    for i in range(600):
        turns = maths.problem(i)
        assert [t["role"] for t in turns] in (["user", "assistant"], ["user", "assistant"] * 2)
        followups += len(turns) == 4
        for t in turns[1::2]:
            assert re.search(r"The answer is -?\d+\.$", t["content"])
            for m in chain.finditer(t["content"]):
                values = {eval(part) for part in m.group(0).split(" = ")}  # noqa: S307 (digits, + - * / ( ) only)
                assert len(values) == 1, (i, m.group(0))
                checked += 1
    assert checked > 600 and 100 < followups < 250
    docs = R.read_maths(50)
    assert docs[3].id == "000003" and docs[3].text == render_chat(maths.problem(3))
    assert docs[3].text.startswith(USER) and ASSISTANT in docs[3].text and docs[3].text.endswith(EOS)


# ---- split, weights, mix ----------------------------------------------------------------------------------------


def test_hash_split_is_stable_disjoint_and_near_its_percentage():
    from pipeline.tiny import data as tdata

    docs = [Doc("bible", f"Book {i}", "x\n") for i in range(20_000)]
    spec = C.KINDS["bible"]
    tr, he = C.split_docs(spec, docs)
    tr2, he2 = C.split_docs(spec, list(reversed(docs)))
    assert {d.id for d in tr} | {d.id for d in he} == {d.id for d in docs}
    assert not {d.id for d in tr} & {d.id for d in he}
    assert {d.id for d in he} == {d.id for d in he2}  # order-free
    assert abs(len(he) / len(docs) - spec.heldout_percent / 100) < 0.01
    # the key is kind-qualified, so the same id splits independently per kind ...
    assert spec.split_key("x") == "bible/x"
    # ... except code, which keeps the stdlib-only build's key (the bare relative path)
    code = C.KINDS["code"]
    for rel in ("os.py", "json/decoder.py", "asyncio/tasks.py", "email/message.py"):
        assert code.is_heldout(rel) == tdata.is_heldout(rel)
    assert C.KINDS["fortunes"].heldout_percent == 10


def test_weights_parse_and_normalise():
    w = C.parse_weights(None, ["code", "maths"])
    assert w == pytest.approx({"code": 0.6, "maths": 0.4})
    w = C.parse_weights("code=1,maths=3,docs=9", ["code", "maths"])  # a kind not built is ignored
    assert w == pytest.approx({"code": 0.25, "maths": 0.75})
    with pytest.raises(ValueError, match="unknown kind"):
        C.parse_weights("prose=1", ["code"])
    assert C.parse_kinds("maths,code") == ["code", "maths"] and C.parse_kinds(None) is None
    with pytest.raises(ValueError, match="unknown kind"):
        C.parse_kinds("code,poetry")
    assert sum(C.DEFAULT_WEIGHTS.values()) == pytest.approx(1.0) and set(C.DEFAULT_WEIGHTS) == set(C.KIND_ORDER)


def test_mix_honours_the_weights():
    train = {"code": _docs("code", 40, 3000), "bible": _docs("bible", 30, 600, 1), "maths": R.read_maths(400)}
    weights = {"code": 0.5, "bible": 0.3, "maths": 0.2}
    total = 200_000
    docs, stats = C.mix_documents(train, weights, total, seed=0)
    chars = {k: sum(len(d.text) for d in docs if d.kind == k) for k in train}
    for k, w in weights.items():
        assert abs(chars[k] / total - w) < 0.005, (k, chars[k])
        assert stats[k]["chars"] == chars[k]
    assert stats["bible"]["passes"] > 1  # short of its share: repeated
    assert [d.id for d in docs] == [d.id for d in C.mix_documents(train, weights, total, seed=0)[0]]
    assert [d.id for d in docs] != [d.id for d in C.mix_documents(train, weights, total, seed=1)[0]]
    # one kind: its training documents once, in order (the stdlib-only build)
    one, st = C.mix_documents({"code": train["code"]}, {"code": 1.0}, total, seed=0)
    assert one == train["code"] and st["code"]["passes"] == 1.0


def test_chat_continuations_take_their_share_and_wrap_text_kinds_only():
    train = {"code": _docs("code", 40, 3000), "maths": R.read_maths(400)}
    docs, stats = C.mix_documents(train, {"code": 0.6, "maths": 0.4}, 100_000, seed=0, chat_frac=0.25)
    chat = [d for d in docs if "@chat" in d.id]
    assert chat and all(d.kind == "code" for d in chat)
    assert abs(sum(len(d.text) for d in chat) / 60_000 - 0.25) < 0.03
    for d in chat:
        assert d.text.startswith(USER) and d.text.count(ASSISTANT) == 1 and d.text.endswith(EOS)
        user, rest = d.text[len(USER):].split(ASSISTANT)
        assert user.endswith("\n") and user.strip() and rest[: -len(EOS)].strip()
    assert stats["maths"]["chat_chars"] == 0


# ---- per-kind prompt sets ---------------------------------------------------------------------------------------


def test_prompt_writer_gives_disjoint_label_and_eval_sets(tmp_path):
    from pipeline.data.sources import bundled_split

    count = lambda s: len(s.split())  # noqa: E731
    text = _docs("docs", 12, 4000)
    cut = P.cut_kind_prompts(C.KINDS["docs"], text, count, n=300, seed=0)
    assert len(cut) == 300 and all(p["id"].startswith("docs/d") for p in cut)
    assert cut == P.cut_kind_prompts(C.KINDS["docs"], text, count, n=300, seed=0)
    mdocs = [d for d in R.read_maths(2000) if C.KINDS["maths"].is_heldout(d.id)]
    mcut = P.cut_kind_prompts(C.KINDS["maths"], mdocs, count, n=60, seed=0)
    assert len(mcut) == 60 and mcut[0]["text"] == mdocs[0].turns[0][1] and mcut[0]["id"] == f"maths/{mdocs[0].id}"
    for kind, prompts in (("docs", cut + cut[:5]), ("maths", mcut)):  # a repeated prompt is written once
        info = P.write_kind_sets(tmp_path, kind, prompts)
        label = P.read_jsonl(tmp_path / f"{kind}-label.jsonl")
        evals = P.read_jsonl(tmp_path / f"{kind}-eval.jsonl")
        assert (info["label"], info["eval"]) == (len(label), len(evals)) and evals and label
        assert not {p["id"] for p in label} & {p["id"] for p in evals}
        assert not {p["text"] for p in label} & {p["text"] for p in evals}
        assert len(label) + len(evals) == len({p["text"] for p in prompts})
        assert all(bundled_split(p["id"]) == "eval" for p in evals)  # the pipeline's own split agrees
        assert all(bundled_split(p["id"]) == "label" for p in label)
        assert set(label[0]) == {"id", "text"}
    assert P.kind_seed("code", 3) == 3 and P.kind_seed("docs", 3) != 3


# ---- missing packages -------------------------------------------------------------------------------------------


def test_a_missing_package_gives_a_message_naming_it(tmp_path, monkeypatch):
    with pytest.raises(KindUnavailable) as err:
        R.read_docs(tmp_path / "no-such-doc")
    assert "python3-doc" in str(err.value) and "apt-get install" in str(err.value)
    with pytest.raises(KindUnavailable, match="fortunes"):
        R.read_fortunes(tmp_path / "no-such-fortunes")
    monkeypatch.setattr(R.shutil, "which", lambda name: None)
    with pytest.raises(KindUnavailable, match="bible-kjv") as err:
        R.read_bible()
    assert err.value.kind == "bible" and "bible-kjv" in err.value.packages


def test_load_kinds_skips_a_missing_kind_loudly_but_fails_when_it_was_asked_for():
    def missing():
        raise KindUnavailable("docs", ("python3-doc",), "no /usr/share/doc/python3*/html folder")

    logged = []
    readers = {"docs": missing, "code": lambda: _docs("code", 3), "bible": lambda: _docs("bible", 3),
               "fortunes": lambda: _docs("fortunes", 3), "maths": lambda: R.read_maths(10)}
    docs, skipped = C.load_kinds(None, logged.append, readers=readers)
    assert list(docs) == ["code", "bible", "fortunes", "maths"] and list(skipped) == ["docs"]
    assert any("SKIPPED" in m and "python3-doc" in m and "apt-get install" in m for m in logged)
    with pytest.raises(KindUnavailable, match="python3-doc"):
        C.load_kinds(["code", "docs"], logged.append, readers=readers)


def test_provenance_records_package_versions_and_the_licence():
    prov = provenance(C.KINDS["code"])
    assert prov["licence"].startswith("PSF-2.0") and prov["packages"][0]["version"]
    assert provenance(C.KINDS["maths"])["packages"] == []
    if dpkg_version("fortunes") is None:
        pytest.skip("the fortune cookies are not installed: apt-get install -y fortunes")
    prov = provenance(C.KINDS["fortunes"])
    assert prov["licence_verified"] and prov["licence"].startswith("BSD-3-Clause")
    assert all(p["version"] for p in prov["packages"])


# ---- the chat template ------------------------------------------------------------------------------------------


def test_render_chat_is_the_saved_tokenizers_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from pipeline.tiny.tokenizer import ROLE_CHAT_TEMPLATE, ROLE_SPECIALS, save_tokenizer, train_tokenizer

    docs = R.read_maths(300)
    tok = train_tokenizer(docs, 400, ROLE_SPECIALS)
    assert [tok.token_to_id(t) for t in ROLE_SPECIALS] == [0, 1, 2, 3]
    assert not any("user" in t or "assistant" in t for t in tok.get_vocab() if t not in ROLE_SPECIALS)
    save_tokenizer(tok, tmp_path, ROLE_CHAT_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    turns = maths.problem(2)
    assert hf.apply_chat_template(turns, tokenize=False) == render_chat(turns)
    one = [{"role": "user", "content": "What is 2 + 3?"}]
    assert hf.apply_chat_template(one, tokenize=False, add_generation_prompt=True) == \
        render_chat(one, add_generation_prompt=True) == USER + "What is 2 + 3?" + ASSISTANT
    ids = hf(render_chat(turns), add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids.count(3) == len(turns) // 2 and ids[-1] == 0
