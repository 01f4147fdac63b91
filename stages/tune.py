"""tune: choose the per-step verify rule (pipeline/policy/step_rules.py) on the label set's held-out prompts.

Input: the label prompts of the val split (``prompts/``, the hash split train uses: the MLP never trained on them),
the first ``tune.limit``; the evaluation sets are never read. Every rule of ``tune.rules`` at every b_max of
``tune.max_block_sizes`` decodes each prompt, beside the fixed b the train stage chose on its split (the baseline
that evaluate's headline also uses). Output ``tune/part-N.parquet``: one row per prompt x method with the verify
lengths of every step and the modelled seconds (the policy's cost profile: the draft's pass at b_max plus the
verify over the tokens sent). ``tune/step_rule.json``: the rule with the least modelled time per token over these
prompts, its gain over the fixed b and the whole table. Evaluate runs that rule on the held-out evaluation sets.

A shortfall against the issue's design, said here too: the rules are scored by decoding these prompts again, not
simulated from what labelling recorded (replay does not keep the draft's per-position probabilities yet).
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Dict, List

import pyarrow as pa

from pipeline.runtime.config import PipelineConfig
from pipeline.data.schemas import TUNE_COLUMNS, TUNE_SCHEMA
from pipeline.io.shards import encode_metadata
from pipeline.executor.folder import require_complete
from pipeline.executor.stage import Plan, Rejects, ShardTask
from pipeline.io.shards import MANIFEST, file_sha256, list_shards, shard_name, write_json_atomic
from pipeline.io.layout import COST_PROFILE, POLICY_META, STEP_RULE, RunLayout
from pipeline.io.storage import location, read_table
from pipeline.policy.blocksize import train_chosen_block_size

from .ray_executor import execute
from .decoding import DecodingStage



def max_block_sizes(cfg: PipelineConfig, B: int) -> List[int]:
    return sorted(set(cfg.tune.max_block_sizes or [max(2, (3 * B) // 2), 2 * B]))


class TuneStage(DecodingStage):
    name = "tune"
    extra_outputs = (STEP_RULE,)

    def __init__(self, cfg: PipelineConfig):
        run = RunLayout(location(cfg.output_dir))
        super().__init__(cfg, run.tune, run.prompts, cfg.tune.num_workers)
        self.train_dir, self.policy_dir = run.train, run.policy

    def requires(self):
        return [(self.train_dir, "blockpilot train"), (self.prompts, "blockpilot prepare")]

    @cached_property
    def policy_info(self) -> Dict[str, Any]:
        return json.loads((self.policy_dir / POLICY_META).read_text())

    @cached_property
    def baseline(self) -> int:
        """The fixed b a user could deploy, as the train stage chose it on the label set's train split."""
        return train_chosen_block_size(self.policy_info)

    @cached_property
    def variants(self) -> List[tuple]:
        B = int(self.policy_info["trained_block_size"])
        return [(rule, bm) for bm in max_block_sizes(self.cfg, B) for rule in self.cfg.tune.rules]

    @property
    def rows_per_input(self) -> int:
        return 1 + len(self.variants)

    def check(self) -> None:
        if not (self.policy_dir / COST_PROFILE).exists():
            raise FileNotFoundError(f"{self.policy_dir / COST_PROFILE} is missing: the rules are scored by modelled "
                                    "time, which needs the policy's cost profile (train with a labelling profile)")
        if self.cfg.decode.temperature > 0:
            raise ValueError("config key 'decode.temperature': tune scores rules at T = 0 (deterministic modelled "
                             "time); run it with decode.temperature=0")

    def fingerprint(self) -> Dict[str, Any]:
        return {"model": vars(self.cfg.model), "decode": vars(self.cfg.decode), "tune": vars(self.cfg.tune),
                "val_fraction": self.cfg.train.val_fraction, "baseline": self.baseline,
                "cost_profile_sha256": file_sha256(self.policy_dir / COST_PROFILE),
                "prompts_manifest_sha256": file_sha256(self.prompts / MANIFEST)}

    def describe(self) -> str:
        return f"b={self.baseline} and {len(self.variants)} rule variants on held-out label prompts"

    def plan(self) -> Plan:
        """The val split's prompts (prompt-id hash, as train splits), the first tune.limit, in shards of 8."""
        from pipeline.policy.blocksize import is_val

        frac, keep = self.cfg.train.val_fraction, []
        for p in list_shards(self.prompts):
            t = read_table(p, columns=["prompt_id", "source", "input_ids"])
            keep += [r for r in t.to_pylist() if is_val(r["prompt_id"], frac)]
            if len(keep) >= self.cfg.tune.limit:
                break
        keep = keep[:self.cfg.tune.limit]
        if not keep:
            raise ValueError("tune: the label prompts have no val-split row (train.val_fraction is 0?)")
        chunks = [keep[i:i + 8] for i in range(0, len(keep), 8)]
        return Plan([ShardTask(shard_name(i), c, len(c)) for i, c in enumerate(chunks)])

    # -- every actor --
    def setup(self, worker) -> None:
        from pipeline.policy.cost import CostProfile

        super().setup(worker)
        self.profile = CostProfile.load(self.policy_dir / COST_PROFILE)

    def process_shard(self, input: List[Dict[str, Any]], rejects: Rejects) -> pa.Table:
        from pipeline.policy.step_rules import parse_rule

        kw = self.decode_kwargs()
        table = pa.Table.from_pylist(input)

        def measure(rec):
            state = self.engine.prefill(self.input_ids(rec))
            out = [(f"b={self.baseline}", self.baseline, None,
                    self.engine.decode(state, block_size=self.baseline, **kw))]
            out += [(f"{rule}@{bm}", bm, rule, self.engine.decode(state, block_size=bm, step_rule=parse_rule(rule),
                                                                   **kw)) for rule, bm in self.variants]
            return out

        rows = []
        for rec, results in self.each_prompt("held-out label prompts", table, rejects, measure):
            for method, b, rule, res in results:
                rows.append({"prompt_id": rec["prompt_id"], "source": rec["source"], "method": method,
                             "block_size": b, "step_rule": rule, "steps": res.steps, "new_tokens": res.new_tokens,
                             "verified": res.verified, "committed": res.committed,
                             "modelled_seconds": self.profile.decode_seconds(res.verified, b, rule=rule is not None,
                                                                             context=res.num_input_tokens),
                             "worker": self.worker.identity})
        meta = encode_metadata({"baseline": self.baseline})
        return pa.Table.from_pylist(rows, schema=TUNE_SCHEMA.with_metadata(meta))

    # -- the driver, at the end --
    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        choice = choose_rule(pa.concat_tables([read_table(p) for p in list_shards(self.folder)]), self.baseline)
        write_json_atomic(choice, self.folder / STEP_RULE)
        return {"step_rule": choice["rule"], "max_block_size": choice["max_block_size"],
                "gain_vs_baseline": choice["gain"], "baseline_b": self.baseline}

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        return [f"chose {summary['step_rule']} at b_max={summary['max_block_size']}: modelled gain "
                f"{summary['gain_vs_baseline']:+.2%} over b={summary['baseline_b']} on held-out label prompts "
                f"(-> {self.folder / STEP_RULE})"]

    def card(self, manifest: Dict[str, Any]) -> str:
        rows = "\n".join(f"| `{n}` | `{t}` | {doc} |" for n, t, doc in TUNE_COLUMNS)
        return ("# BlockPilot per-step rule tuning\n\nOne row per held-out label prompt x method; `step_rule.json` "
                f"holds the chosen rule.\n\n| column | type | meaning |\n| --- | --- | --- |\n{rows}\n")


def choose_rule(results: pa.Table, baseline: int) -> Dict[str, Any]:
    """The variant with the least modelled time per token (sum of seconds / sum of tokens over the prompts, the
    ratio of means evaluate's speedups use); its gain over the fixed baseline; every variant's line."""
    import polars as pl

    df = pl.from_arrow(results.select(["method", "block_size", "step_rule", "modelled_seconds", "new_tokens"]))
    per = (df.group_by(["method", "block_size", "step_rule"])
             .agg(pl.col("modelled_seconds").sum(), pl.col("new_tokens").sum(), pl.len().alias("prompts"))
             .with_columns((pl.col("modelled_seconds") / pl.col("new_tokens")).alias("tpot")).sort("tpot"))
    base = per.filter(pl.col("method") == f"b={baseline}")["tpot"][0]
    table = [{"method": r["method"], "rule": r["step_rule"], "max_block_size": int(r["block_size"]),
              "modelled_time_per_token": r["tpot"], "gain": base / r["tpot"] - 1, "prompts": int(r["prompts"])}
             for r in per.iter_rows(named=True)]
    rules = [t for t in table if t["rule"] is not None]
    best = rules[0]
    return {"rule": best["rule"], "max_block_size": best["max_block_size"], "gain": best["gain"],
            "baseline_b": baseline, "chosen_on": "held-out (val split) label prompts", "prompts": best["prompts"],
            "table": table}


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    stage = TuneStage(cfg)
    require_complete(stage.requires())
    return execute(stage)
