"""The bundled prompt sets, per kind of text: cut from each kind's held-out documents, split into a label set and an
eval set by a hash of the prompt id, and written as ``prompts/<kind>-label.jsonl`` and ``prompts/<kind>-eval.jsonl``
(``{"id", "text"}`` per line, in a fixed order; any prefix of a file is a random sample of it).

- Text kinds: :func:`pipeline.tiny.data.cut_prompts` (line-boundary prefixes of 64-256 tokens of the tiny tokenizer,
  seeded) with ids ``<prefix>/<doc id>#L<first>-L<last>``.
- Dialogue kinds (maths): the first user turn of each held-out problem, in problem order, id ``maths/<id>``; the
  pipeline puts it through the chat template, and the target answers as the assistant.
- Split: a prompt is in ``eval`` iff ``int(sha256(id)[:8], 16) % 10 == 0``, the rule of
  ``pipeline.data.sources.bundled_split`` (so a loader that re-splits a file by id agrees with the file); a prompt
  whose text equals an earlier prompt's of the kind is dropped first, so no text is in both sets.
- ``code`` also keeps ``stdlib-heldout.jsonl`` (the historical set, all its prompts; the code sets are the split
  of its first ``n`` prompts).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.tiny import data as tdata
from pipeline.tiny.kinds import Doc, KindSpec

EVAL_MODULUS = 10


def prompt_split(prompt_id: str) -> str:
    """``"eval"`` for one prompt id in ten, else ``"label"`` (pipeline.data.sources.bundled_split's rule)."""
    return "eval" if int(hashlib.sha256(str(prompt_id).encode("utf-8")).hexdigest()[:8], 16) % EVAL_MODULUS == 0 \
        else "label"


def kind_seed(kind: str, seed: int) -> int:
    """The prompt-cutting seed of a kind (``code`` keeps the build seed itself, as the stdlib-only build did)."""
    return seed if kind == "code" else seed + int(hashlib.sha1(kind.encode()).hexdigest()[:6], 16)


def cut_kind_prompts(spec: KindSpec, heldout: list[Doc], count_tokens, n: int, seed: int) -> list[dict]:
    if spec.dialogue:
        out = []
        for d in heldout:
            if len(out) >= n:
                break
            first = next((c for r, c in d.turns if r == "user"), None)
            if first and first.strip():
                out.append({"id": f"{spec.prompt_prefix}/{d.id}", "text": first, "num_tokens": count_tokens(first)})
        return out
    return tdata.cut_prompts(heldout, count_tokens, n=n, seed=kind_seed(spec.name, seed), prefix=spec.prompt_prefix)


def split_prompts(prompts: list[dict]) -> tuple[list[dict], list[dict]]:
    """(label, eval), each in the input order; exact-text duplicates dropped (the first kept)."""
    seen, label, evals = set(), [], []
    for p in prompts:
        if p["text"] in seen:
            continue
        seen.add(p["text"])
        (evals if prompt_split(p["id"]) == "eval" else label).append(p)
    return label, evals


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in rows:
            f.write(json.dumps({"id": p["id"], "text": p["text"]}, ensure_ascii=False) + "\n")


def write_kind_sets(out_dir: Path, kind: str, prompts: list[dict]) -> dict:
    """Write ``<kind>-label.jsonl`` and ``<kind>-eval.jsonl``; returns their counts and file names."""
    label, evals = split_prompts(prompts)
    write_jsonl(out_dir / f"{kind}-label.jsonl", label)
    write_jsonl(out_dir / f"{kind}-eval.jsonl", evals)
    tok = [p.get("num_tokens") for p in label + evals if p.get("num_tokens") is not None]
    return {"label": len(label), "eval": len(evals), "files": [f"{kind}-label.jsonl", f"{kind}-eval.jsonl"],
            "mean_tokens": round(sum(tok) / len(tok), 1) if tok else None}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


__all__ = ["cut_kind_prompts", "kind_seed", "prompt_split", "read_jsonl", "split_prompts", "write_jsonl",
           "write_kind_sets"]
