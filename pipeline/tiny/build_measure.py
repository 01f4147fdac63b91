"""Step 7 of the tiny build: the reloaded pair measured per kind, on the first ``--eval-prompts`` prompts of each
kind's eval set, each put through the chat template as the pipeline's prepare does when the tokenizer has roles.
The tables (tau over block sizes 1..16, pooled and per kind, with the held-out loss) go into the model cards and
the numbers into the build history (``history["measure"]``).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.tiny import prompts as tprompts
from pipeline.tiny.training import log


def format_for_target(hf_tok, text: str, chat: bool) -> str:
    """A prompt as the pipeline's prepare gives it to the target (one user turn through the chat template)."""
    if not chat:
        return text
    return hf_tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def measure_by_kind(rt, rtarget, rdraft, prompts_dir: Path, kinds: list[str], eval_prompts: int, dialogue: bool,
                    eos_id: int, kind_loss: dict[str, float], history: dict):
    """``(report_md, kinds_md, measure_desc)``, all None when nothing was measured; fills ``history["measure"]``."""
    from pipeline.tiny.measure import format_kinds, kind_line, measure_kinds, merge_reports

    report_md = None
    measure_desc = None
    kinds_md = None

    by_kind = {}
    for k in kinds:
        path = prompts_dir / f"{k}-eval.jsonl"
        if not path.exists():
            log(f"measurement: no {path}, kind {k} not measured")
            continue
        texts = [p["text"] for p in tprompts.read_jsonl(path)][: eval_prompts]
        by_kind[k] = [
            rt(format_for_target(rt, t, dialogue), return_tensors="pt", add_special_tokens=False)["input_ids"]
            for t in texts
        ]
    reps = measure_kinds(rtarget, rdraft, by_kind, max_new_tokens=128, stop_token_ids=[eos_id], log=log)
    if reps:
        rep = merge_reports(list(reps.values()))
        report_md = rep.format()
        kinds_md = format_kinds(reps, kind_loss)
        measure_desc = (
            f"The first {eval_prompts} prompts of each kind's held-out eval set "
            f"(`prompts/<kind>-eval.jsonl`; {', '.join(f'{k} {len(v)}' for k, v in by_kind.items())}), "
            + ("each as one user turn through the chat template with the generation prompt (what the "
               "pipeline's prepare does), " if dialogue else "")
            + "T = 0, max_new_tokens 128, stop at `<|endoftext|>`, float32 on CPU, "
            "`dflash.model.dflash_generate`; tau = mean tokens committed per verify step (bonus included). "
            "The first table pools every kind's prompts."
        )
        log("measurement (all kinds):\n" + report_md)
        log("measurement per kind:\n" + kinds_md)
        for k, r in reps.items():
            log(kind_line(k, r, kind_loss.get(k)))
        history["measure"] = {
            "mean_tau": {b: round(rep.mean_tau(b), 4) for b in rep.block_sizes},
            "argmax_share": {b: round(s, 4) for b, s in rep.argmax_share().items()},
            "lossless": rep.all_lossless(),
            "per_kind": {
                k: {
                    "prompts": len(r.tau[r.block_sizes[0]]),
                    "heldout_loss": round(kind_loss[k], 4),
                    "mean_tau": {b: round(r.mean_tau(b), 4) for b in r.block_sizes},
                    "argmax_share": {b: round(s, 4) for b, s in r.argmax_share().items()},
                    "lossless": r.all_lossless(),
                    "mean_new_tokens": round(sum(r.new_tokens) / max(1, len(r.new_tokens)), 1),
                }
                for k, r in reps.items()
            },
        }
    return report_md, kinds_md, measure_desc


__all__ = ["format_for_target", "measure_by_kind"]
