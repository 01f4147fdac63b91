"""tune: choose the per-step verify rule (pipeline/policy/step_rules.py) on the label set's held-out prompts.

Offline first (pipeline.evaluation.rule_search, on the driver): the acceptance model of the learned rule is fitted
on the label set's train-split traces, then every rule of ``tune.rules`` (``learned`` included) is simulated on
EVERY val-split row from its trace at the label set's b_max, beside the train-chosen fixed b and the per-step
oracle, and scored by modelled time (the policy's cost profile). The evaluation sets are never read. Beyond
``tune.max_rows`` rows of a split, a fixed random subset of that many (pipeline.evaluation.rule_search.read_traced:
a large label set's traces would not fit the driver); step_rule.json's ``rows_read`` says how many were read and
used.

Then a decoded confirmation: the first ``tune.limit`` val prompts are decoded with the chosen rule, the best
threshold rule, the learned rule and the fixed b (``tune/part-N.parquet``, one row per prompt x method), and every
decode's per-step lengths are compared with the simulator's (``confirmed`` in step_rule.json).

Outputs: ``tune/step_rule.json`` (the choice, every rule's line, the oracle's gain and each rule's share of it, the
acceptance model's reliability table on val, the confirmation), ``tune/verify_model.json`` (the learned rule: the
acceptance model and the step seconds; pipeline.policy.step_rules.load_rule reads it), ``tune/simulated.parquet``
(one row per val prompt x simulated method).
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Dict, List, Optional

import pyarrow as pa

from pipeline.data.schemas import TUNE_COLUMNS, TUNE_SCHEMA
from pipeline.evaluation.load_check import CHECK_DOC, check_lines, summary_of
from pipeline.evaluation.rule_search import adoption_line, family, read_traced, search
from pipeline.executor.folder import require_complete
from pipeline.executor.stage import Plan, Rejects, ShardTask
from pipeline.io.layout import COST_PROFILE, LOAD_CHECK, POLICY_META, STEP_RULE, VERIFY_MODEL, RunLayout
from pipeline.executor.ray.executor import execute
from pipeline.io.shards import (MANIFEST, encode_metadata, file_sha256, labels_revisions, list_shards, shard_name,
                                write_json_atomic, write_parquet_atomic)
from pipeline.io.storage import location, read_table
from pipeline.policy.blocksize import train_chosen_block_size
from pipeline.policy.step_rules import LEARNED
from pipeline.runtime.config import PipelineConfig

from .decoding import DecodingStage
from .load_check import run_check

SIMULATED = "simulated.parquet"


class TuneStage(DecodingStage):
    name = "tune"
    extra_outputs = (STEP_RULE, VERIFY_MODEL, SIMULATED, LOAD_CHECK)

    def __init__(self, cfg: PipelineConfig):
        run = RunLayout(location(cfg.output_dir))
        super().__init__(cfg, run.tune, run.prompts, cfg.tune.num_workers, "tune.num_workers")
        self.train_dir, self.policy_dir, self.labels, self.layout = run.train, run.policy, run.labels, run

    def requires(self):
        return [(self.train_dir, "blockpilot train"), (self.labels, "blockpilot label"),
                (self.prompts, "blockpilot prepare")]

    @cached_property
    def policy_info(self) -> Dict[str, Any]:
        return json.loads((self.policy_dir / POLICY_META).read_text())

    @property
    def largest_block(self) -> int:
        """What tune decodes at most (its rules' b_max, a candidate): the cost profile times every b the run
        decodes."""
        return max(int(b) for b in self.profile.seconds)

    @cached_property
    def baseline(self) -> int:
        """The fixed b a user could deploy, as the train stage chose it on the label set's train split."""
        return train_chosen_block_size(self.policy_info)

    @cached_property
    def profile(self):
        from pipeline.policy.cost import CostProfile

        return CostProfile.load(self.policy_dir / COST_PROFILE)

    @cached_property
    def traced(self) -> Dict[str, Any]:
        """The label rows the search reads (driver side), read once: at most tune.max_rows of each split."""
        t = self.cfg.train
        return read_traced(list_shards(self.labels), t.val_fraction, t.calibration_fraction, self.cfg.tune.max_rows)

    @cached_property
    def searched(self) -> Dict[str, Any]:
        """The offline search (driver side): fit, simulate, choose."""
        return search(self.traced, self.cfg.tune.rules, self.profile, self.baseline, self.cfg.decode.max_new_tokens)

    @property
    def confirm_rules(self) -> List[str]:
        """What the decoded confirmation runs: the chosen rule and the best of each family tried."""
        c = self.searched["choice"]
        return list(dict.fromkeys([c["rule"], *(f["rule"] for f in c["families"].values())]))

    @property
    def rows_per_input(self) -> int:
        return 1 + len(self.confirm_rules)

    def recorded_revisions(self) -> Dict[str, str]:
        return labels_revisions(self.labels)

    def check(self) -> None:
        self.check_revisions()
        if not (self.policy_dir / COST_PROFILE).exists():
            raise FileNotFoundError(f"{self.policy_dir / COST_PROFILE} is missing: the rules are scored by modelled "
                                    "time, which needs the policy's cost profile (train with a labelling profile)")
        if self.cfg.decode.temperature > 0:
            raise ValueError("config key 'decode.temperature': tune scores rules at T = 0 (deterministic modelled "
                             "time); run it with decode.temperature=0")

    def fingerprint(self) -> Dict[str, Any]:
        return {"model": vars(self.cfg.model), "models": self.provenance, "decode": vars(self.cfg.decode),
                "tune": vars(self.cfg.tune),
                "val_fraction": self.cfg.train.val_fraction,
                "calibration_fraction": self.cfg.train.calibration_fraction, "baseline": self.baseline,
                # None when missing: check() then refuses with its own message (the driver fingerprints first).
                "cost_profile_sha256": file_sha256(self.policy_dir / COST_PROFILE)
                if (self.policy_dir / COST_PROFILE).exists() else None,
                "labels_manifest_sha256": file_sha256(self.labels / MANIFEST),
                "prompts_manifest_sha256": file_sha256(self.prompts / MANIFEST)}

    def describe(self) -> str:
        return (f"{len(self.cfg.tune.rules)} rules simulated on the label set's val split, the best decoded on "
                f"{self.cfg.tune.limit} of its prompts beside b={self.baseline}")

    def plan(self) -> Plan:
        """The first tune.limit prompts of the val split (those the search simulated), in shards of 8, each task
        carrying the rules to decode (the learned one as its JSON)."""
        wanted = {r["prompt_id"] for r in self.searched["rows"]}
        keep = []
        for p in list_shards(self.prompts):
            t = read_table(p, columns=["prompt_id", "source", "input_ids"])
            keep += [r for r in t.to_pylist() if r["prompt_id"] in wanted]
            if len(keep) >= self.cfg.tune.limit:
                break
        keep = keep[:self.cfg.tune.limit]
        learned = self.searched["learned"]
        spec = {"rules": self.confirm_rules, "learned": learned.to_dict() if learned is not None else None,
                "max_block_size": self.searched["choice"]["max_block_size"]}
        chunks = [keep[i:i + 8] for i in range(0, len(keep), 8)]
        return Plan([ShardTask(shard_name(i), {"prompts": c, **spec}, len(c)) for i, c in enumerate(chunks)])

    # -- every actor --
    def process_shard(self, input: Dict[str, Any], rejects: Rejects) -> pa.Table:
        from pipeline.policy.step_rules import LearnedVerify, parse_rule

        kw, bm = self.decode_kwargs(), int(input["max_block_size"])
        rules = {r: (LearnedVerify.from_dict(input["learned"]) if r == LEARNED else parse_rule(r))
                 for r in input["rules"]}
        table = pa.Table.from_pylist(input["prompts"])

        def measure(rec):
            state = self.engine.prefill(self.input_ids(rec))
            out = [(f"b={self.baseline}", self.baseline, None,
                    self.engine.decode(state, block_size=self.baseline, **kw))]
            out += [(rule, bm, rule, self.engine.decode(state, block_size=bm, step_rule=obj, **kw))
                    for rule, obj in rules.items()]
            return out

        rows = []
        for rec, results in self.each_prompt("held-out label prompts", table, rejects, measure):
            for method, b, rule, res in results:
                rows.append({"prompt_id": rec["prompt_id"], "source": rec["source"],
                             "method": method if rule is None else f"{rule}@{b}", "block_size": b,
                             "step_rule": rule, "steps": res.steps, "new_tokens": res.new_tokens,
                             "verified": res.verified, "committed": res.committed,
                             "modelled_seconds": self.profile.decode_seconds(res.verified, b, rule=rule is not None,
                                                                             context=res.num_input_tokens),
                             "worker": self.worker.identity})
        return pa.Table.from_pylist(rows, schema=TUNE_SCHEMA.with_metadata(encode_metadata({"baseline": self.baseline})))

    # -- the driver, at the end --
    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        s = self.searched
        decoded = pa.concat_tables([read_table(p) for p in list_shards(self.folder)])
        choice = {**s["choice"], "confirmed": confirm(decoded, s["rows"], self.baseline),
                  "rows_read": self.traced["counts"]}
        # b*(c) against no speculation, measured at the evaluated loads (the shards' actors are gone: the task gets
        # a worker's resources); the rules at load are then searched against the schedule it leaves
        check = run_check(self.cfg, self)
        choice["load"] = self.at_load(check.get("schedule"))
        write_parquet_atomic(pa.Table.from_pylist(s["rows"], schema=TUNE_SCHEMA), self.folder / SIMULATED)
        if s["learned"] is not None:
            write_json_atomic(s["learned"].to_dict(), self.folder / VERIFY_MODEL)
        write_json_atomic(choice, self.folder / STEP_RULE)
        fam = choice["families"]
        return {"step_rule": choice["rule"], "max_block_size": choice["max_block_size"],
                "gain_vs_baseline": choice["gain"], "baseline_b": self.baseline, "prompts": choice["prompts"],
                "oracle_gain": choice["per_step_oracle"]["gain"],
                "families": {f: {"rule": t["rule"], "gain": t["gain"], "oracle_gain_captured": t["oracle_gain_captured"]}
                             for f, t in fam.items()},
                "adoption": choice["adoption"], "rows_read": choice["rows_read"],
                "simulated_equals_decoded": choice["confirmed"]["simulated_equals_decoded"],
                "load": {c: {k: v[k] for k in ("rule", "gain", "baseline_b")} for c, v in choice["load"].items()},
                **({"load_check": summary_of(check)} if check else {})}

    def at_load(self, checked: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        """The rule at each c > 1 of train's schedule (a version-3 cost profile) as the load check left it
        (``checked``), simulated on the same val rows; none where b*(c) = 1: no speculation there, no rule either
        (evaluate runs none)."""
        from pipeline.evaluation.rule_search import search_at_load
        from pipeline.policy.load_cost import LoadCost

        sched = {int(c): int(b) for c, b in (checked or self.policy_info.get("schedule") or {}).items()}
        if len(sched) < 2:
            return {}
        sched = {c: b for c, b in sched.items() if c == 1 or b > 1}
        return search_at_load(self.traced, self.cfg.tune.rules, LoadCost.from_profile(self.profile), sched,
                              self.cfg.decode.max_new_tokens)

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        fams = ", ".join(f"{f} {t['rule']} {t['gain']:+.2%}" for f, t in summary["families"].items())
        return [f"chose {summary['step_rule']} at b_max={summary['max_block_size']}: modelled gain "
                f"{summary['gain_vs_baseline']:+.2%} over b={summary['baseline_b']} on {summary['prompts']} held-out "
                f"label prompts (simulated; per-step oracle {summary['oracle_gain']:+.2%}; best per family: {fams})",
                adoption_line(summary["adoption"]), *_capped_line(summary.get("rows_read")),
                f"decoded confirmation: {summary['simulated_equals_decoded']} (-> {self.folder / STEP_RULE})",
                *(["at load (simulated): " + "; ".join(f"c={c} {v['rule']} {v['gain']:+.2%} over b={v['baseline_b']}"
                                                         for c, v in summary["load"].items())]
                  if summary.get("load") else []),
                *(check_lines(summary["load_check"]) if summary.get("load_check") else [])]

    def card(self, manifest: Dict[str, Any]) -> str:
        rows = "\n".join(f"| `{n}` | `{t}` | {doc} |" for n, t, doc in TUNE_COLUMNS)
        return ("# BlockPilot per-step rule tuning\n\nThe shards: one row per decoded held-out label prompt x method; "
                f"`{SIMULATED}`: one row per val prompt x simulated method (worker `simulated`; the fixed b's row "
                "has no per-step lengths); `step_rule.json` holds the chosen rule.\n\n"
                f"| column | type | meaning |\n| --- | --- | --- |\n{rows}\n" + CHECK_DOC)


def _capped_line(counts: Optional[Dict[str, Any]]) -> List[str]:
    """What tune.max_rows left out, when it left any row out (else nothing)."""
    if not counts or counts["used"] == counts["traced"]:
        return []
    used, traced = counts["used"], counts["traced"]
    return [f"read {used['val']:,} of {traced['val']:,} val rows and {used['train']:,} of {traced['train']:,} others "
            f"(tune.max_rows={counts['max_rows']:,}: a fixed random subset)"]


def confirm(decoded: pa.Table, simulated: List[Dict[str, Any]], baseline: int) -> Dict[str, Any]:
    """Decoded against simulated, per prompt and rule: equal per-step lengths (the simulator's exactness on this
    run's own prompts), and each rule's modelled gain over the fixed b on the decoded prompts."""
    sim = {(r["prompt_id"], r["method"]): r for r in simulated}
    rows = decoded.to_pylist()
    ruled = [r for r in rows if r["step_rule"] is not None]
    equal = sum(sim.get((r["prompt_id"], r["method"]), {}).get("verified") == r["verified"] for r in ruled)
    base = {r["prompt_id"]: r for r in rows if r["step_rule"] is None}
    gains = {}
    for method in sorted({r["method"] for r in ruled}):
        mine = [r for r in ruled if r["method"] == method]
        s = sum(r["modelled_seconds"] for r in mine)
        gains[method] = {"rule": mine[0]["step_rule"], "family": family(mine[0]["step_rule"]),
                         "decoded_gain": sum(base[r["prompt_id"]]["modelled_seconds"] for r in mine) / s - 1,
                         "prompts": len(mine)}
    return {"simulated_equals_decoded": f"{equal}/{len(ruled)} decodes", "equal": equal, "decodes": len(ruled),
            "gains": gains}


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    stage = TuneStage(cfg)
    require_complete(stage.requires())
    return execute(stage)

