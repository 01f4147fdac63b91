"""evaluate: adaptive decoding with the policy vs autoregressive, every fixed block size, and the oracle.

The held-out prompt sets (``evaluate.sources``) are built by prepare's own stage into ``eval/prompts/``; decoding
actors (placed as in ``label``) turn each prompt shard into a result shard ``eval/part-NNNNN.parquet`` with one row
per prompt x method (resumable shard by shard, through :mod:`pipeline.executor.driver`); at the end the driver writes
``eval/results.parquet`` (every shard's rows) and the summary tables ``eval/summary.md`` / ``eval/summary.csv``.

Methods per prompt, all from one shared prefill:
* ``AR``: b = 1, plain autoregressive decoding (the speedup reference);
* ``b=N``: each fixed block size (default: the paper's DFlash(4/8/16/32) scaled to B, i.e. {B/4, B/2, B, 2B},
  plus every candidate in C);
* ``adaptive``: the product's adaptive decoder (pipeline.decoding.adaptive): the policy's choice from the prefill logits
  (its latency is measured and recorded), whose fallback b is replaced by the per-step rule ``blockpilot tune`` chose
  on held-out label prompts when tune measured it faster there;
* with a tuned rule, its two parts apart: ``policy`` (the policy alone, every step verifying the whole block) and
  ``per-step`` (the rule alone at its b_max);
* ``oracle``: the candidate with the best measured tau for this prompt (ties to the smaller b), read from the
  fixed-b decodes.

speedup = mean time per output token of AR / mean time per output token of the method, per dataset (as DFlash's
benchmark computes it). Time per output token = decode seconds / new tokens (the prefill is the same for all).
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Dict, List, Optional

import pyarrow as pa

from pipeline.runtime.config import PipelineConfig
from pipeline.data.schemas import RESULT_COLUMNS, RESULTS_SCHEMA
from pipeline.io.shards import encode_metadata
from pipeline.executor.driver import Rejects, Worker, require_complete
from pipeline.io.shards import MANIFEST, file_sha256, list_shards, write_parquet_atomic, write_text_atomic
from pipeline.io.storage import location, read_table

from .ray_executor import execute
from .decoding import DecodingStage
from .prepare import PrepareStage

from pipeline.policy.step_rules import parse_rule

POLICY_FILES = ("policy.json", "model.safetensors")
COST_PROFILE = "cost_profile.json"  # train copies the profile its policy was trained with beside the policy


def default_fixed_block_sizes(B: int, candidates: List[int]) -> List[int]:
    """The paper compares DFlash at b = 4, 8, 16, 32 with B = 16: {B/4, B/2, B, 2B}, plus every candidate."""
    scaled = {max(2, B // 4), max(2, B // 2), B, 2 * B}
    return sorted(scaled | set(candidates))


def prompt_sets(cfg: PipelineConfig) -> PrepareStage:
    """The held-out prompt sets, built by prepare's own stage (same cleaning, chat template and fingerprint) into
    ``eval/prompts/``."""
    return PrepareStage(cfg, location(cfg.output_dir) / "eval" / "prompts", cfg.evaluate.sources, cfg.evaluate.limit,
                        section="evaluate")


PER_STEP, POLICY_ONLY = "per-step", "policy"


def methods_for(fixed: List[int], per_step: bool = False) -> List[str]:
    return ["AR", *[f"b={b}" for b in fixed], "adaptive", *([POLICY_ONLY, PER_STEP] if per_step else []), "oracle"]


class EvaluateStage(DecodingStage):
    """eval/prompts/part-N -> eval/part-N: one row per prompt x method."""

    name = "evaluate"
    extra_outputs = ("results.parquet", "summary.md", "summary.csv")

    def __init__(self, cfg: PipelineConfig):
        out = location(cfg.output_dir)
        super().__init__(cfg, out / "eval", prompt_sets(cfg).folder, cfg.evaluate.num_workers)
        self.train_dir, self.policy_dir = out / "train", out / "train" / "policy"
        self.tune_dir = out / "tune"

    def requires(self):
        return [(self.train_dir, "blockpilot train"), (self.prompts, "blockpilot evaluate")]  # see run()

    @cached_property
    def policy_info(self) -> Dict[str, Any]:
        return json.loads((self.policy_dir / "policy.json").read_text())

    @property
    def candidates(self) -> List[int]:
        return [int(b) for b in self.policy_info["candidates"]]

    @property
    def block_size(self) -> int:
        return int(self.policy_info.get("trained_block_size", self.candidates[len(self.candidates) // 2]))

    @cached_property
    def fixed(self) -> List[int]:
        return sorted(self.cfg.evaluate.fixed_block_sizes or default_fixed_block_sizes(self.block_size,
                                                                                       self.candidates))

    @cached_property
    def step_rule(self) -> Optional[Dict[str, Any]]:
        """The per-step rule `blockpilot tune` chose on held-out label prompts (tune/step_rule.json), when
        evaluate.per_step and the tune stage is complete; else None."""
        from pipeline.io.shards import is_complete

        from .tune import RULE_FILE

        if not self.cfg.evaluate.per_step or not is_complete(self.tune_dir):
            return None
        return json.loads((self.tune_dir / RULE_FILE).read_text())

    @cached_property
    def rule_fallback(self):
        from pipeline.decoding.adaptive import RuleFallback
        from pipeline.policy.blocksize import SPEED_SCORE

        # Only a speed policy has a fallback b for the rule to replace (a classifier always takes its argmax).
        if self.step_rule is None or self.policy_info.get("score") != SPEED_SCORE:
            return None
        return RuleFallback.from_tune(self.step_rule)

    @property
    def methods(self) -> List[str]:
        return methods_for(self.fixed, self.step_rule is not None)

    @property
    def rows_per_input(self) -> int:
        return len(self.methods)

    def fingerprint(self) -> Dict[str, Any]:
        profile = self.policy_dir / COST_PROFILE
        return {"model": vars(self.cfg.model), "decode": vars(self.cfg.decode), "fixed": self.fixed,
                "policy_sha256": {f: file_sha256(self.policy_dir / f) for f in POLICY_FILES},
                "cost_profile_sha256": file_sha256(profile) if profile.exists() else None,
                "step_rule": self.step_rule and {k: self.step_rule[k] for k in ("rule", "max_block_size")},
                "rule_fallback": vars(self.rule_fallback) if self.rule_fallback else None,
                "prompts_manifest_sha256": file_sha256(self.prompts / MANIFEST)}

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
        # values, not V); its weights are what a serving loop touches once per request, which on the tiny pair (a
        # 2.4M-parameter target) shows in the next decode's wall clock. The policy on raw logits, as trained, is
        # asked too on every adaptive row (``unfolded_block_size``; finalize counts the agreements).
        try:
            serving = policy.fold(self.models.target.lm_head)
            self.unfolded = AdaptiveDecoder(self.engine, policy, self.rule_fallback)
        except ValueError:  # a policy on transformed logits does not fold: it serves on the logits
            serving, self.unfolded = policy, None
        # The product's decoder (the tuned rule replacing the fallback b, when tune measured it faster on held-out
        # label prompts) and, with a rule, the policy alone (the "policy" method).
        self.adaptive = AdaptiveDecoder(self.engine, serving, self.rule_fallback)
        self.policy_only = AdaptiveDecoder(self.engine, serving)
        self.cost_profile = self._cost_profile()

    def _cost_profile(self):
        from pipeline.policy.cost import CostProfile

        path = self.policy_dir / COST_PROFILE
        return CostProfile.load(path) if path.exists() else None

    def oracle_choice(self, fixed: Dict[int, Any]) -> int:
        """The per-prompt best candidate: the fastest by modelled time (steps x the profiled step cost; ties to the
        smaller b) when the policy came with a cost profile, else the longest acceptance (the paper's oracle)."""
        from pipeline.labelling.labels import argmax_smallest

        cands = self.candidates
        if self.cost_profile is None:
            return cands[argmax_smallest([fixed[b].tau for b in cands])]
        return cands[argmax_smallest([-fixed[b].steps * self.cost_profile.cost(b) for b in cands])]

    def _modelled(self, b: int, res) -> Optional[float]:
        """Modelled decode seconds: per step, the draft's pass over the block and the verify over what was sent
        (pipeline.policy.cost.CostProfile.step_seconds); a plain step at b costs cost(b)."""
        if self.cost_profile is None:
            return None
        if res.step_rule is None:
            return res.steps * self.cost_profile.cost(b)
        return sum(self.cost_profile.step_seconds(b, v) for v in res.verified)

    def _row(self, rec, method, kind, b, res, prefill_s, policy_s, ar_ids) -> Dict[str, Any]:
        import torch

        return {"modelled_seconds": self._modelled(b, res), "step_rule": None, "policy_block_size": None,
                "prompt_id": rec["prompt_id"], "source": rec["source"], "method": method, "kind": kind,
                "block_size": b, "tau": res.tau, "steps": res.steps, "new_tokens": res.new_tokens,
                "decode_seconds": res.decode_seconds,
                "time_per_output_token": res.decode_seconds / max(1, res.new_tokens),
                "prefill_seconds": prefill_s, "policy_seconds": policy_s,
                "matches_autoregressive": bool(torch.equal(res.output_ids, ar_ids)), "worker": self.worker.identity}

    def reference(self, ids, ar):
        """What every method's output must equal: at T = 0 the target's plain greedy decoding, computed by an
        independent loop (so a bug shared by all block sizes of the engine, b = 1 included, still shows)."""
        if self.cfg.decode.temperature > 0:
            return ar.output_ids
        from pipeline.decoding.engine import greedy_reference

        return greedy_reference(self.models.target, ids, self.cfg.decode.max_new_tokens, self.engine.stop_token_ids)

    def process_shard(self, input: str, rejects: Rejects) -> pa.Table:
        kw, cands = self.decode_kwargs(), self.candidates

        def measure(rec):
            ids = self.input_ids(rec)
            state = self.engine.prefill(ids)
            ar = self.engine.decode(state, block_size=1, **kw)
            fixed = {b: self.engine.decode(state, block_size=b, **kw) for b in sorted(set(self.fixed) | set(cands))}
            ad = {"adaptive": self.adaptive.generate(ids, state=state, **kw)}
            steps = {}
            if self.step_rule is not None:  # the two parts apart: the policy alone, the tuned rule alone
                ad[POLICY_ONLY] = self.policy_only.generate(ids, state=state, **kw)
                bm = int(self.step_rule["max_block_size"])
                steps[PER_STEP] = (bm, self.engine.decode(state, block_size=bm,
                                                          step_rule=parse_rule(self.step_rule["rule"]), **kw))
            return state, ar, fixed, ad, steps, self.reference(ids, ar)

        table = read_table(input, columns=["prompt_id", "source", "input_ids"])
        rows: List[Dict[str, Any]] = []
        for rec, (state, ar, fixed, ad, steps, ref) in self.each_prompt(input, table, rejects, measure):
            p = state.prefill_seconds
            rows.append(self._row(rec, "AR", "autoregressive", 1, ar, p, None, ref))
            rows += [self._row(rec, f"b={b}", "fixed", b, fixed[b], p, None, ref) for b in self.fixed]
            for method, a in ad.items():
                row = self._row(rec, method, method, a.block_size, a.decode, p, a.policy_seconds, ref)
                row.update(step_rule=a.step_rule, policy_block_size=a.policy_block_size)
                if method == "adaptive":  # the policy on raw logits, beside the folded (serving) form's choice
                    row["unfolded_block_size"] = self.unfolded.choose(state)[0] if self.unfolded is not None else None
                rows.append(row)
            for method, (b, res) in steps.items():
                r = self._row(rec, method, method, b, res, p, None, ref)
                r["step_rule"] = self.step_rule["rule"]
                rows.append(r)
            best = self.oracle_choice(fixed)
            rows.append(self._row(rec, "oracle", "oracle", best, fixed[best], p, None, ref))
        meta = {"candidates": cands, "fixed_block_sizes": self.fixed, "temperature": self.cfg.decode.temperature,
                "max_new_tokens": self.cfg.decode.max_new_tokens}
        return pa.Table.from_pylist(rows, schema=RESULTS_SCHEMA.with_metadata(encode_metadata(meta)))

    # -- the driver, at the end --
    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        results = pa.concat_tables([read_table(p) for p in list_shards(self.folder)])
        write_parquet_atomic(results, self.folder / "results.parquet", compression="zstd")
        profile = self._cost_profile()
        if profile is not None:  # modelled time per token: the profiled step costs (see _modelled) / new tokens
            modelled = [s / max(1, n) for s, n in zip(results.column("modelled_seconds").to_pylist(),
                                                      results.column("new_tokens").to_pylist())]
            results = results.append_column("modelled_time_per_output_token", pa.array(modelled, pa.float64()))
        summary = summarize(results, self.methods)
        summary.update({"candidates": self.candidates, "fixed_block_sizes": self.fixed,
                        "trained_block_size": self.block_size})
        summary["comparisons"] = self.comparisons(results, summary)
        summary["folded_policy"] = folded_agreement(results)
        kinds = ("modelled", "wall") if profile is not None else ("wall",)
        summary["headline"] = {kind: headline_numbers(results, summary, self.policy_info, kind) for kind in kinds}
        rf = self.rule_fallback
        summary["headline"]["adaptive_is"] = (
            f"the policy, its fallback b replaced by the per-step rule {rf.rule} at b_max={rf.max_block_size} (tune: "
            f"{rf.gain:+.2%} over the fallback b on held-out label prompts)" if rf else "the policy alone")
        if self.step_rule is not None:
            # adaptive's two parts apart, each against the same train-chosen fixed b: the policy alone (every step
            # verifying its whole block) and the rule alone, as tune chose it on held-out label prompts.
            for key, method in (("policy_only", POLICY_ONLY), ("per_step", PER_STEP)):
                summary["headline"][key] = {
                    "method": method, "rule": self.step_rule["rule"] if method == PER_STEP else None,
                    "max_block_size": self.step_rule["max_block_size"] if method == PER_STEP else "the policy's b",
                    "chosen_on": self.step_rule.get("chosen_on") if method == PER_STEP else "the label set",
                    "tune_gain": self.step_rule.get("gain") if method == PER_STEP else None,
                    **{kind: headline_numbers(results, summary, self.policy_info, kind, method=method)
                       for kind in kinds}}
        write_text_atomic(render_markdown(summary), self.folder / "summary.md")
        write_text_atomic(render_csv(summary), self.folder / "summary.csv")
        return summary

    def comparisons(self, results: pa.Table, summary: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Adaptive against the fixed b a user could deploy without seeing these prompts (the one train chose on
        the label set's train split, policy.json's best_fixed_block_size), and against the hindsight-best fixed b
        on these very prompts (the fastest on average here), each with its bootstrap interval."""
        fixed = [m for m in self.methods if m.startswith("b=")]
        speed = summary["tables"]["speedup"]
        hindsight = max(fixed, key=lambda m: speed[m]["average"] or 0)
        chosen = self.policy_info.get("best_fixed_block_size")
        out = []
        if chosen is not None and f"b={chosen}" in fixed:
            out.append({"against": f"b={chosen}", "chosen_on": "the label set's train split (" + self.policy_info.get(
                        "best_fixed_chosen_on", "by mean tau").replace("the train split, ", "") + ")",
                        **gain_with_interval(results, "adaptive", f"b={chosen}")})
        out.append({"against": hindsight, "chosen_on": "these evaluation prompts (hindsight, the fastest)",
                    **gain_with_interval(results, "adaptive", hindsight)})
        return out

    def card(self, manifest: Dict[str, Any]) -> str:
        rows = "\n".join(f"| `{n}` | `{t}` | {doc} |" for n, t, doc in RESULT_COLUMNS)
        return (f"# BlockPilot evaluation results\n\nOne row per prompt x method ({', '.join(self.methods)}); "
                "`results.parquet` holds every shard's rows, `summary.md` / `summary.csv` the tables.\n\n"
                f"| column | type | meaning |\n| --- | --- | --- |\n{rows}\n")

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        speed = summary["tables"]["speedup"]
        return ["average speedup vs AR: " + ", ".join(
            f"{m} {_fmt(speed[m].get('average'), 2, 'x')}" for m in self.methods) + " (tables: summary.md)"]


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    stage = EvaluateStage(cfg)
    require_complete([(stage.train_dir, "blockpilot train")])  # before building prompt sets for nothing
    execute(prompt_sets(cfg))
    return execute(stage)


def summarize(results: pa.Table, methods: List[str]) -> Dict[str, Any]:
    """Per dataset and method: mean tau, speedup vs AR (ratio of mean time per output token), and more."""
    import polars as pl

    df = pl.from_arrow(results)
    modelled = "modelled_time_per_output_token" in df.columns
    datasets = sorted(df["source"].unique().to_list())
    per = (df.group_by(["source", "method"])
             .agg(pl.col("tau").mean().alias("tau"), pl.col("time_per_output_token").mean().alias("tpot"),
                  (pl.col("modelled_time_per_output_token").mean() if modelled else pl.lit(None, pl.Float64))
                  .alias("mtpot"),
                  pl.col("matches_autoregressive").mean().alias("lossless"), pl.len().alias("prompts"),
                  pl.col("policy_seconds").mean().alias("policy_seconds"),
                  pl.col("prefill_seconds").mean().alias("prefill_seconds")))
    table: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {"tau": {}, "speedup": {}, "lossless": {}}
    if modelled:  # steps x profiled step cost: deterministic at T = 0, free of the shared machine's noise
        table["modelled_speedup"] = {}
    for m in methods:
        for metric in table:
            table[metric][m] = {}
        for ds in datasets:
            row = per.filter((pl.col("source") == ds) & (pl.col("method") == m))
            ar = per.filter((pl.col("source") == ds) & (pl.col("method") == "AR"))
            if row.height == 0:
                continue
            table["tau"][m][ds] = float(row["tau"][0])
            table["speedup"][m][ds] = float(ar["tpot"][0] / row["tpot"][0]) if ar.height else None
            table["lossless"][m][ds] = float(row["lossless"][0])
            if modelled:
                table["modelled_speedup"][m][ds] = float(ar["mtpot"][0] / row["mtpot"][0]) if ar.height else None
        for metric in table:
            vals = [v for v in table[metric][m].values() if v is not None]
            table[metric][m]["average"] = sum(vals) / len(vals) if vals else None
    adaptive = df.filter(pl.col("method") == "adaptive")
    chosen = adaptive.group_by("policy_block_size").len().sort("policy_block_size")
    return {
        "datasets": datasets, "methods": methods, "tables": table,
        "prompts": {ds: int(df.filter((pl.col("source") == ds) & (pl.col("method") == "AR")).height)
                    for ds in datasets},
        "adaptive_choices": {int(b): int(n) for b, n in zip(chosen["policy_block_size"], chosen["len"])},
        "adaptive_rule_rows": int(adaptive["step_rule"].is_not_null().sum()),
        "policy_ms_mean": float(adaptive["policy_seconds"].mean() * 1e3) if adaptive.height else None,
        "prefill_ms_mean": float(adaptive["prefill_seconds"].mean() * 1e3) if adaptive.height else None,
    }


def folded_agreement(results: pa.Table) -> Dict[str, Any]:
    """On every adaptive row: did the folded policy (final hidden state; what adaptive ran) choose what the policy
    on raw logits (as trained) chose?"""
    rows = [r for r in results.select(["method", "policy_block_size", "unfolded_block_size"]).to_pylist()
            if r["method"] == "adaptive" and r["unfolded_block_size"] is not None]
    agree = sum(r["policy_block_size"] == r["unfolded_block_size"] for r in rows)
    return {"prompts": len(rows), "agree": agree, "all_equal": agree == len(rows)}


def headline_numbers(results: pa.Table, summary: Dict[str, Any], policy_info: Dict[str, Any], kind: str,
                     reps: int = 2000, seed: int = 0, method: str = "adaptive") -> Dict[str, Any]:
    """The headline for one time measure (``modelled``: steps x profiled step cost; ``wall``: measured seconds):
    average speedups vs AR over the sets of adaptive, the best fixed b chosen on the label set's train split, the
    hindsight-fastest fixed b on these prompts and the oracle; gain = adaptive / best_fixed - 1 with a 95 %
    percentile bootstrap interval over prompts (resampled within each set, every method of a prompt kept
    together, the statistic recomputed exactly); oracle_gain_captured = (adaptive - best_fixed) / (oracle -
    best_fixed). ``per_set`` has the same per evaluation set, with the oracle's headroom over the best fixed b."""
    import numpy as np
    import polars as pl

    table = summary["tables"]["modelled_speedup" if kind == "modelled" else "speedup"]
    col = "modelled_time_per_output_token" if kind == "modelled" else "time_per_output_token"
    fixed = [m for m in summary["methods"] if m.startswith("b=")]
    hindsight = max(fixed, key=lambda m: table[m]["average"] or 0)
    chosen = policy_info.get("fallback_block_size") or policy_info.get("best_fixed_block_size")
    base = f"b={chosen}" if chosen is not None and f"b={chosen}" in fixed else hindsight
    df = pl.from_arrow(results.select(["source", "prompt_id", "method", col]))
    rng = np.random.default_rng(seed)
    sets = summary["datasets"]
    methods = ["AR", method, base, "oracle"]
    boot_speed = {m: [] for m in methods}  # [set][reps]
    per_set = {}
    for ds in sets:
        wide = (df.filter(pl.col("source") == ds).pivot(on="method", index="prompt_id", values=col)
                .sort("prompt_id"))
        t = {m: wide[m].to_numpy().astype(np.float64) for m in methods}
        idx = rng.integers(0, len(t["AR"]), size=(reps, len(t["AR"])))
        ar = t["AR"][idx].mean(axis=1)
        for m in methods:
            boot_speed[m].append(ar / t[m][idx].mean(axis=1))
        g = boot_speed[method][-1] / boot_speed[base][-1] - 1
        a, b, o = (table[m][ds] for m in (method, base, "oracle"))
        per_set[ds] = {"adaptive": a, "best_fixed": b, "oracle": o, "gain": a / b - 1,
                       "gain_ci95": [float(np.percentile(g, 2.5)), float(np.percentile(g, 97.5))],
                       "oracle_headroom": o / b - 1, "oracle_gain_captured": (a - b) / (o - b) if o > b else None,
                       "hindsight_fixed_b": int(max(fixed, key=lambda m: table[m][ds] or 0)[2:]),
                       "prompts": int(len(t["AR"]))}
    avg = {m: np.mean(boot_speed[m], axis=0) for m in methods}
    g = avg[method] / avg[base] - 1
    a, b, o = (table[m]["average"] for m in (method, base, "oracle"))
    return {"method": method, "adaptive": a, "best_fixed_b": int(base[2:]), "best_fixed": b, "hindsight_fixed_b": int(hindsight[2:]),
            "hindsight_fixed": table[hindsight]["average"], "oracle": o, "gain": a / b - 1,
            "gain_ci95": [float(np.percentile(g, 2.5)), float(np.percentile(g, 97.5))],
            "oracle_gain_captured": (a - b) / (o - b) if o > b else None, "oracle_headroom": o / b - 1,
            "best_fixed_chosen_on": "the label set's train split" if base == f"b={chosen}" else
            "hindsight (the policy names no best fixed b)",
            "per_set": per_set}


def gain_with_interval(results: pa.Table, method: str, baseline: str, reps: int = 2000, seed: int = 0
                       ) -> Dict[str, Any]:
    """Wall-clock gain of ``method`` over ``baseline``: mean time per output token of the baseline / the method's,
    minus 1, per dataset and averaged over datasets, each with a 95 % percentile bootstrap interval over prompts
    (prompts resampled with replacement within each dataset; a prompt's two rows stay paired)."""
    import numpy as np
    import polars as pl

    df = pl.from_arrow(results).select("source", "prompt_id", "method", "time_per_output_token")
    rng = np.random.default_rng(seed)
    out: Dict[str, Any] = {}
    boot = []
    for ds in sorted(df["source"].unique().to_list()):
        sub = df.filter(pl.col("source") == ds)
        pair = (sub.filter(pl.col("method") == method).join(
            sub.filter(pl.col("method") == baseline), on="prompt_id", suffix="_base").sort("prompt_id"))
        a = pair["time_per_output_token"].to_numpy().astype(np.float64)
        b = pair["time_per_output_token_base"].to_numpy().astype(np.float64)
        idx = rng.integers(0, len(a), size=(reps, len(a)))
        g = b[idx].mean(axis=1) / a[idx].mean(axis=1) - 1
        boot.append(g)
        out[ds] = {"gain": float(b.mean() / a.mean() - 1), "ci95": [float(np.percentile(g, 2.5)),
                                                                     float(np.percentile(g, 97.5))],
                   "prompts": int(len(a))}
    avg = np.mean(boot, axis=0)
    out["average"] = {"gain": float(np.mean([v["gain"] for v in out.values()])),
                      "ci95": [float(np.percentile(avg, 2.5)), float(np.percentile(avg, 97.5))]}
    return out


def _fmt(v: Optional[float], digits: int = 2, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


def render_markdown(s: Dict[str, Any]) -> str:
    cols = [*s["datasets"], "average"]
    out = ["# Evaluation", "",
           f"Prompts per dataset: {s['prompts']}. Candidates {s['candidates']}; policy latency "
           f"{_fmt(s['policy_ms_mean'], 3)} ms vs prefill {_fmt(s['prefill_ms_mean'], 3)} ms (mean). "
           f"The policy's choices (b: prompts): {s['adaptive_choices']}; adaptive decoded "
           f"{s.get('adaptive_rule_rows', 0)} of them with the tuned per-step rule (the policy answered its fallback "
           "b).", ""]
    for metric, title, suffix in (("tau", "Acceptance length tau (tokens per verify step)", ""),
                                  ("speedup", "Speedup vs autoregressive (ratio of mean time per output token)", "x"),
                                  ("modelled_speedup", "Modelled speedup vs autoregressive (steps x profiled step "
                                   "cost; deterministic at T = 0)", "x"),
                                  ("lossless", "Share of prompts whose output equals autoregressive output", "")):
        out += [f"## {title}", "", "| method | " + " | ".join(cols) + " |",
                "| --- |" + " ---: |" * len(cols)]
        if metric not in s["tables"]:
            out = out[:-4]
            continue
        for m in s["methods"]:
            vals = s["tables"][metric].get(m, {})
            out.append(f"| {m} | " + " | ".join(_fmt(vals.get(c), 3, suffix) for c in cols) + " |")
        out.append("")
    headline = s.get("headline", {})
    sections = [(kind, "adaptive", headline[kind]) for kind in ("modelled", "wall") if kind in headline]
    for key in ("policy_only", "per_step"):  # adaptive's two parts apart: the policy alone, the tuned rule alone
        if key in headline:
            name = headline[key]["method"] + (f" ({headline[key]['rule']})" if headline[key]["rule"] else "")
            sections += [(kind, name, headline[key][kind]) for kind in ("modelled", "wall") if kind in headline[key]]
    for kind, name, h in sections:
        out += [f"## Headline ({kind}): {name} vs the best fixed b chosen on the label set's train split (b="
                f"{h['best_fixed_b']}), the hindsight-fastest fixed b and the oracle; gain with its 95 % bootstrap "
                "interval over prompts", "",
                f"| set | {name} | best fixed | hindsight fixed | oracle | oracle headroom | gain [95 % CI] | "
                "share of the oracle's gain |", "| --- |" + " ---: |" * 7]
        for ds, v in [*h["per_set"].items(), ("average", {**h, "hindsight_fixed_b": h["hindsight_fixed_b"]})]:
            hind = h["hindsight_fixed"] if ds == "average" else s["tables"][
                "modelled_speedup" if kind == "modelled" else "speedup"][f"b={v['hindsight_fixed_b']}"][ds]
            cap = "-" if v["oracle_gain_captured"] is None else f"{v['oracle_gain_captured']:.0%}"
            out.append(f"| {ds} | {v['adaptive']:.3f}x | {v['best_fixed']:.3f}x | b={v['hindsight_fixed_b']} "
                       f"{hind:.3f}x | {v['oracle']:.3f}x | {v['oracle_headroom']:+.1%} | {v['gain']:+.2%} "
                       f"[{v['gain_ci95'][0]:+.2%}, {v['gain_ci95'][1]:+.2%}] | {cap} |")
        out.append("")
    if s.get("folded_policy"):
        f = s["folded_policy"]
        out += [f"Folded policy (reads the final hidden state): same choice as the policy on logits on {f['agree']} "
                f"of {f['prompts']} prompts.", ""]
    if s.get("comparisons"):
        out += ["## Adaptive against a fixed block size (wall-clock gain, 95 % bootstrap interval over prompts)", "",
                "| against | chosen on | " + " | ".join(cols) + " |", "| --- | --- |" + " ---: |" * len(cols)]
        for c in s["comparisons"]:
            cells = [f"{c[ds]['gain']:+.1%} [{c[ds]['ci95'][0]:+.1%}, {c[ds]['ci95'][1]:+.1%}]" for ds in cols]
            out.append(f"| {c['against']} | {c['chosen_on']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def render_csv(s: Dict[str, Any]) -> str:
    cols = [*s["datasets"], "average"]
    lines = ["metric,method," + ",".join(cols)]
    for metric in ("tau", "speedup", "modelled_speedup"):
        if metric not in s["tables"]:
            continue
        for m in s["methods"]:
            vals = s["tables"][metric].get(m, {})
            lines.append(f"{metric},{m}," + ",".join("" if vals.get(c) is None else f"{vals[c]:.4f}" for c in cols))
    return "\n".join(lines) + "\n"
