"""evaluate: adaptive decoding with the policy vs autoregressive, every fixed block size, and the oracle.

The held-out prompt sets (``evaluate.sources``) are built by prepare's own stage into ``eval/prompts/``; decoding
actors (placed as in ``label``) turn each prompt shard into ``eval/part-NNNNN.parquet``, one row per prompt x method
(resumable shard by shard); at the end the driver writes ``eval/results.parquet`` and ``eval/summary.{md,csv}``; then
the pass at load (:mod:`stages.evaluate_load`). The methods, result rows, summary, headline and the cost model's
check against wall clock: :mod:`pipeline.evaluation`.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Dict, List, Optional

import pyarrow as pa

from pipeline.runtime.config import PipelineConfig
from pipeline.data.schemas import RESULTS_SCHEMA
from pipeline.evaluation.cost_check import cost_check
from pipeline.evaluation.headline import comparisons, headlines, train_chosen_b
from pipeline.evaluation.methods import (PER_STEP, POLICY_ONLY, fixed_block_sizes, methods_for,
                                         oracle_block_size, rule_methods)
from pipeline.evaluation.render import render_csv, render_markdown, results_card, summary_lines
from pipeline.evaluation.distribution import distribution_summary
from pipeline.evaluation.results import Sampled, result_row, with_modelled_time
from pipeline.runtime.seeds import draw_seed
from pipeline.evaluation.summary import folded_agreement, summarize
from pipeline.io.layout import COST_PROFILE, POLICY_FILES, POLICY_META, RunLayout
from pipeline.executor.folder import require_complete
from pipeline.executor.stage import Rejects, Worker
from pipeline.executor.ray.executor import execute
from pipeline.io.shards import (MANIFEST, encode_metadata, file_sha256, labels_revisions, list_shards,
                                write_parquet_atomic, write_text_atomic)
from pipeline.io.storage import location, read_table
from pipeline.policy.step_rules import load_rule

from .decoding import DecodingStage
from .prepare import PrepareStage


# Prompts per evaluation shard: a shard is one actor's unit of work, and the default's 64 evaluation prompts in one
# shard of prepare.shard_size left one of its two actors idle for the whole stage.
EVAL_SHARD_SIZE = 8


def prompt_sets(cfg: PipelineConfig) -> PrepareStage:
    """The held-out prompt sets, built by prepare's own stage (same cleaning, chat template and fingerprint) into
    ``eval/prompts/``, in shards of EVAL_SHARD_SIZE prompts."""
    return PrepareStage(cfg, RunLayout(location(cfg.output_dir)).eval_prompts, cfg.evaluate.sources,
                        cfg.evaluate.limit, section="evaluate", shard_size=EVAL_SHARD_SIZE)


class EvaluateStage(DecodingStage):
    """eval/prompts/part-N -> eval/part-N: one row per prompt x method."""

    name = "evaluate"
    extra_outputs = ("results.parquet", "summary.md", "summary.csv")

    def __init__(self, cfg: PipelineConfig):
        run = RunLayout(location(cfg.output_dir))
        super().__init__(cfg, run.eval, prompt_sets(cfg).folder, cfg.evaluate.num_workers,
                         "evaluate.num_workers")
        self.layout = run
        self.train_dir, self.policy_dir, self.tune_dir = run.train, run.policy, run.tune

    def requires(self):
        return [(self.train_dir, "blockpilot train"), (self.prompts, "blockpilot evaluate")]  # see run()

    def recorded_revisions(self) -> Dict[str, str]:
        return labels_revisions(self.layout.labels)

    def check(self) -> None:
        self.check_revisions()

    @cached_property
    def policy_info(self) -> Dict[str, Any]:
        return json.loads((self.policy_dir / POLICY_META).read_text())

    @property
    def candidates(self) -> List[int]:
        return [int(b) for b in self.policy_info["candidates"]]

    @property
    def block_size(self) -> int:
        return int(self.policy_info.get("trained_block_size", self.candidates[len(self.candidates) // 2]))

    @cached_property
    def fixed(self) -> List[int]:
        return fixed_block_sizes(self.cfg.evaluate.fixed_block_sizes, self.block_size, self.candidates)

    @cached_property
    def step_rule(self) -> Optional[Dict[str, Any]]:
        """The per-step rule `blockpilot tune` chose on held-out label prompts, when evaluate.per_step and the tune
        stage is complete; else None."""
        from pipeline.io.shards import is_complete

        if not self.cfg.evaluate.per_step or not is_complete(self.tune_dir):
            return None
        return json.loads(self.layout.step_rule.read_text())

    @cached_property
    def rule_fallback(self):
        from pipeline.decoding.adaptive import RuleFallback
        from pipeline.policy.blocksize import SPEED_SCORE

        # Only a speed policy has a fallback b for the rule to replace (a classifier always takes its argmax).
        if self.step_rule is None or self.policy_info.get("score") != SPEED_SCORE:
            return None
        return RuleFallback.from_tune(self.step_rule, self.tune_dir)

    @cached_property
    def rule_methods(self) -> Dict[str, str]:
        return rule_methods(self.step_rule)

    @property
    def methods(self) -> List[str]:
        return methods_for(self.fixed, self.step_rule is not None, [m for m in self.rule_methods if m != PER_STEP])

    @property
    def rows_per_input(self) -> int:
        return len(self.methods)

    def fingerprint(self) -> Dict[str, Any]:
        profile = self.policy_dir / COST_PROFILE
        return {"model": vars(self.cfg.model), "models": self.provenance, "decode": vars(self.cfg.decode),
                "fixed": self.fixed,
                "policy_sha256": {f: file_sha256(self.policy_dir / f) for f in POLICY_FILES},
                "cost_profile_sha256": file_sha256(profile) if profile.exists() else None,
                "step_rule": self.step_rule and {k: self.step_rule[k] for k in ("rule", "max_block_size")},
                "rule_fallback": self.rule_fallback and {k: getattr(self.rule_fallback, k)
                                                         for k in ("rule", "max_block_size", "gain")},
                "verify_model_sha256": file_sha256(self.layout.verify_model)
                if self.step_rule is not None and self.layout.verify_model.exists() else None,
                "prompts_manifest_sha256": file_sha256(self.prompts / MANIFEST),
                # only where it is not 1, so that a T = 0 folder made before the key existed still resumes
                **({"samples": self.samples} if self.samples > 1 else {})}

    def describe(self) -> str:
        return f"methods {self.methods}"

    # -- every actor --
    def setup(self, worker: Worker) -> None:
        from pipeline.decoding.adaptive import AdaptiveDecoder
        from pipeline.policy.blocksize import BlockSizePolicy

        super().setup(worker)
        policy = BlockSizePolicy.from_pretrained(self.policy_dir, device=self.models.device)
        if policy.vocab_size != self.models.vocab_size:
            raise ValueError(f"policy {self.policy_dir} was trained on V={policy.vocab_size}, "
                             f"the target has V={self.models.vocab_size}")
        # Adaptive runs the serving form: the policy folded through lm_head, reading the final hidden state (H
        # values, not V): its weights are what a serving loop touches once per request (figures:
        # benchmarks/results/evaluate-folded-policy.md). The policy on raw logits, as trained, is asked too on every
        # adaptive row (``unfolded_block_size``; finalize counts the agreements).
        try:
            serving = policy.fold(self.models.target.lm_head)
            self.unfolded = AdaptiveDecoder(self.engine, policy, self.rule_fallback)
        except ValueError:  # a policy on transformed logits does not fold: it serves on the logits
            serving, self.unfolded = policy, None
        # The product's decoder (the tuned rule replacing the fallback b, when tune measured it faster on held-out
        # label prompts its choice did not see) and, with a rule, the policy alone (the "policy" method).
        self.adaptive = AdaptiveDecoder(self.engine, serving, self.rule_fallback)
        self.policy_only = AdaptiveDecoder(self.engine, serving)
        self.cost_profile = self._cost_profile()
        self.rules = {m: load_rule(r, self.tune_dir) for m, r in self.rule_methods.items()}

    def _cost_profile(self):
        from pipeline.policy.cost import CostProfile

        path = self.policy_dir / COST_PROFILE
        return CostProfile.load(path) if path.exists() else None

    def reference(self, ids):
        """What every method's output must equal: at T = 0 the target's plain greedy decoding, computed by an
        independent loop (so a bug shared by all block sizes of the engine, b = 1 included, still shows); None at
        T > 0, where the outputs are checked by distribution (``pit``)."""
        if self.cfg.decode.temperature > 0:
            return None
        from pipeline.decoding.engine import greedy_reference

        return greedy_reference(self.models.target, ids, self.cfg.decode.max_new_tokens, self.engine.stop_token_ids)

    @property
    def samples(self) -> int:
        """Draws per prompt x method: evaluate.samples at T > 0; one at T = 0 (every draw would be the same)."""
        return self.cfg.evaluate.samples if self.cfg.decode.temperature > 0 else 1

    def pit(self, res: Sampled, prompt_id: str) -> Optional[List[float]]:
        """At T > 0 the distribution check's values of every token of every draw (None at T = 0)."""
        d = self.cfg.decode
        if d.temperature <= 0:
            return None
        from pipeline.evaluation.distribution import pit_values

        return [u for r, run in enumerate(res.runs) for u in pit_values(
            self.models.target, run.output_ids, run.num_input_tokens, d.temperature, d.top_p, d.top_k,
            seed=draw_seed(d.seed, prompt_id, r, "pit"))]

    def process_shard(self, input: str, rejects: Rejects) -> pa.Table:
        kw, cands = self.decode_kwargs(), self.candidates
        seed = kw.pop("seed")

        def measure(rec):
            seeds = [draw_seed(seed, rec["prompt_id"], r) for r in range(self.samples)]

            def draws(decode):  # decode(seed) for every draw of this prompt
                return [decode(s) for s in seeds]

            ids = self.input_ids(rec)
            state = self.engine.prefill(ids)
            ar = Sampled(draws(lambda s: self.engine.decode(state, block_size=1, seed=s, **kw)))
            fixed = {b: Sampled(draws(lambda s: self.engine.decode(state, block_size=b, seed=s, **kw)))
                     for b in self.fixed}  # every candidate among them (methods.fixed_block_sizes)
            ad = {"adaptive": draws(lambda s: self.adaptive.generate(ids, state=state, seed=s, **kw))}
            steps = {}
            if self.step_rule is not None:  # the two parts apart: the policy alone, the tuned rule(s) alone
                ad[POLICY_ONLY] = draws(lambda s: self.policy_only.generate(ids, state=state, seed=s, **kw))
                bm = int(self.step_rule["max_block_size"])
                steps = {m: (bm, Sampled(draws(lambda s: self.engine.decode(state, block_size=bm, step_rule=rule,
                                                                            seed=s, **kw))))
                         for m, rule in self.rules.items()}
            return state, ar, fixed, ad, steps, self.reference(ids), self.per_step_check(ids, steps)

        table = read_table(input, columns=["prompt_id", "source", "input_ids"])
        rows: List[Dict[str, Any]] = []
        for rec, (state, ar, fixed, ad, steps, ref, check) in self.each_prompt(input, table, rejects, measure):
            p = state.prefill_seconds

            def row(method, kind, b, res, policy_s=None, pit=None):
                return result_row(rec, method, kind, b, res, p, policy_s, ref, self.worker.identity,
                                  self.cost_profile, pit if pit is not None else self.pit(res, rec["prompt_id"]))

            rows.append(row("AR", "autoregressive", 1, ar))
            fixed_rows = {b: row(f"b={b}", "fixed", b, fixed[b]) for b in self.fixed}
            rows += fixed_rows.values()
            for method, runs in ad.items():
                a = runs[0]  # the policy's choice is the same for every draw: it reads the prefill
                r = row(method, method, a.block_size, Sampled([x.decode for x in runs]),
                        sum(x.policy_seconds for x in runs) / len(runs))
                r.update(step_rule=a.step_rule, policy_block_size=a.policy_block_size, policy_action=a.policy_action)
                if method == "adaptive":  # the policy on raw logits, beside the folded (serving) form's choice
                    r["unfolded_action"] = self.unfolded.choose(state)[0].name if self.unfolded is not None else None
                rows.append(r)
            for method, (b, res) in steps.items():
                rows.append({**row(method, PER_STEP, b, res), "step_rule": self.rule_methods[method],
                             "simulated_equals_decoded": check.get(method),
                             "per_step_oracle_seconds": check.get("oracle") if method == PER_STEP else None})
            best = oracle_block_size(cands, fixed, self.cost_profile)
            rows.append(row("oracle", "oracle", best, fixed[best], pit=fixed_rows[best]["pit"]))
        meta = {"candidates": cands, "fixed_block_sizes": self.fixed, "temperature": self.cfg.decode.temperature,
                "max_new_tokens": self.cfg.decode.max_new_tokens, "samples": self.samples}
        return pa.Table.from_pylist(rows, schema=RESULTS_SCHEMA.with_metadata(encode_metadata(meta)))

    def per_step_check(self, ids, steps) -> Dict[str, Any]:
        """At T = 0, with rules decoded and a cost profile: each rule's simulated lengths against its decode, and
        the per-step oracle's modelled seconds (pipeline.labelling.labels.per_step_check); {} otherwise."""
        if not steps or self.cfg.decode.temperature > 0 or self.cost_profile is None:
            return {}
        from pipeline.labelling.labels import per_step_check

        return per_step_check(self.engine, ids, {m: (self.rules[m], res.runs[0].verified) for m, (_, res) in
                                                 steps.items()}, int(self.step_rule["max_block_size"]),
                              self.cfg.decode.max_new_tokens, self.cost_profile)

    # -- the driver, at the end --
    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        results = pa.concat_tables([read_table(p) for p in list_shards(self.folder)])
        write_parquet_atomic(results, self.folder / "results.parquet", compression="zstd")
        profile = self._cost_profile()
        if profile is not None:
            results = with_modelled_time(results)
        summary = summarize(results, self.methods)
        summary.update({"candidates": self.candidates, "fixed_block_sizes": self.fixed,
                        "trained_block_size": self.block_size,
                        "train_chosen_b": train_chosen_b(self.policy_info)})
        summary["comparisons"] = comparisons(results, summary, self.policy_info)
        summary["folded_policy"] = folded_agreement(results)
        summary["samples"] = self.samples
        summary["distribution"] = distribution_summary(results, self.methods)
        summary["cost_model"] = cost_check(results, summary) if profile is not None else {}
        kinds = ("modelled", "wall") if profile is not None else ("wall",)
        summary["headline"] = headlines(results, summary, self.policy_info, kinds, self.step_rule, self.rule_fallback)
        write_text_atomic(render_markdown(summary), self.folder / "summary.md")
        write_text_atomic(render_csv(summary), self.folder / "summary.csv")
        return summary

    def card(self, manifest: Dict[str, Any]) -> str:
        from pipeline.evaluation.load import LOAD_CARD

        return results_card(self.methods) + LOAD_CARD

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        return summary_lines(summary, self.methods)


def run(cfg: PipelineConfig, load_tables: bool = True) -> Dict[str, Any]:
    """``load_tables``: print the table of each c > 1 when measured (``blockpilot run`` prints them in its closing
    block instead, once)."""
    stage = EvaluateStage(cfg)
    require_complete([(stage.train_dir, "blockpilot train")])  # before building prompt sets for nothing
    execute(prompt_sets(cfg))
    summary = execute(stage)
    from .evaluate_load import run_load, with_load  # c > 1 of evaluate.concurrency: every prompt served c at a time

    loads = run_load(cfg, stage, load_tables)
    return {**summary, **with_load(stage, summary, loads)} if loads else summary
