"""What vLLM can serve, priced per load, and which of it deploy prints (issue 68): plain vLLM (no speculative config),
one fixed K, one batch-size schedule (``num_speculative_tokens_per_batch_size``), and, where no one of them is the
fastest at every load, plain and speculative servers with the load routed between them. Ray-free, numpy only.

**A schedule's K = 0 is not plain vLLM.** A server started with a speculative config runs the drafter's forward at
every step, also where the step's K is 0, "to keep the drafter KV cache in sync" (vLLM 0.32.0,
vllm/v1/spec_decode/llm_base_proposer.py, the ``num_speculative_tokens == 0`` branch); only a server without
``--speculative-config`` skips it. So the options are priced with two different costs for "no speculation":

* plain vLLM: the profile's b = 1 (AR) step, timed without a drafter (our engine's AR; vLLM's profile times it in a
  plain engine: pipeline.labelling.vllm_labels.measure_profile; a sweep's runs without a speculative config);
* a schedule's K = 0 range: the profile's ``speculative_k0`` seconds at that c where it was timed in a speculative
  engine at K = 0 (vllm_labels.measure_profile, or a sweep's speculative runs at K = 0); where it was not, a b = 2 step
  committing one token (the drafter's forward over the step's tokens and a verify no narrower than plain's): an
  estimate, said as such.

Expected output tokens per second of an option at c: ``c / mean over the train rows of (step seconds / tau)`` (the
modelled time per token train and b*(c) minimise, pipeline.policy.load_cost.schedule), tau = 1 at K = 0.

Choice (:func:`choose`): each single option's regret is its largest shortfall against the best option at any load
of the grid; the single option with the least regret is deployed when that regret is at most ``SPLIT_MIN_GAIN``
(ties: plain, then the fixed K, then the schedule, the simpler first). Otherwise no one server is right at every
load, and deploy prints a plain and a speculative server with the load routed by the number of running requests:
plain vLLM at the loads where it is fastest, the speculative option (the schedule, or the fixed K where that is
faster wherever speculation wins) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

PLAIN, FIXED, SCHEDULE, SPLIT = "plain vLLM", "fixed K", "schedule", "split"
ORDER = (PLAIN, FIXED, SCHEDULE)  # ties to the simpler
# A single server is deployed when it is within this share of the best option at every load of the grid; beyond it,
# a routed plain + speculative pair (two servers and a router) is worth its trouble.
SPLIT_MIN_GAIN = 0.02
K0_ESTIMATE = ("not timed in a speculative engine at K = 0: estimated as a b = 2 step committing one token (vLLM runs "
               "the drafter's forward at K = 0, vllm/v1/spec_decode/llm_base_proposer.py)")


@dataclass
class Options:
    """Each option's K and expected output tokens/s at each load of the grid, and what deploy serves."""

    loads: List[int]
    k: Dict[str, Dict[int, int]]  # option -> c -> K there (plain: 0)
    tokens_per_s: Dict[str, Dict[int, float]]  # option -> c -> expected output tokens/s over c streams
    k0: Dict[int, str]  # c -> how a speculative server's K = 0 is priced there ("measured" or K0_ESTIMATE)
    chosen: str = ""  # PLAIN | FIXED | SCHEDULE | SPLIT
    speculative: Optional[str] = None  # FIXED or SCHEDULE: the speculative server of the choice (None: plain only)
    serve: Dict[int, str] = field(default_factory=dict)  # c -> the option deploy serves at c
    regret: Dict[str, float] = field(default_factory=dict)
    why: str = ""
    measured: Dict[int, str] = field(default_factory=dict)  # grid c -> why plain there: the vLLM check's verdict
    notes: List[str] = field(default_factory=list)  # how a b the labels never measured was priced

    def pays(self, c: int) -> bool:
        """Deploy said speculation pays at c: it serves a speculative option there, modelled faster than plain."""
        o = self.serve[c]
        return o != PLAIN and self.tokens_per_s[o][c] > self.tokens_per_s[PLAIN][c]

    def ratio(self, c: int, option: Optional[str] = None, over: str = PLAIN) -> float:
        o = option or self.serve[c]
        return self.tokens_per_s[o][c] / self.tokens_per_s[over][c]


def price(tau_train: np.ndarray, candidates: Sequence[int], cost: Callable[[int, int], float],
          loads: Sequence[int], fixed_b: int, schedule: Dict[int, int],
          k0_seconds: Optional[Dict[int, float]] = None) -> Options:
    """Each option's expected tokens/s at each load. ``cost(b, c)``: seconds of one batched step of c streams at b
    (b = 1: plain vLLM, no drafter); ``k0_seconds``: {c: a speculative server's step at K = 0}, measured."""
    tau = np.asarray(tau_train, dtype=np.float64)
    cands = [int(b) for b in candidates]

    notes: List[str] = []

    def tau_at(b: int) -> np.ndarray:
        if b in cands:
            return tau[:, cands.index(b)]
        # a b the labels never measured (a small b tune's load check kept): tau is at most b and at most the tau of
        # the next labelled b above it (tau grows with b): that bound, said so (optimistic for speculation)
        above = [x for x in sorted(cands) if x > b]
        bound = np.minimum(tau[:, cands.index(above[0])], b) if above else tau[:, cands.index(max(cands))]
        note = (f"b={b} was never labelled: its tau bounded by min(b, tau at b={above[0]})" if above else
                f"b={b} was never labelled: its tau taken as at b={max(cands)}")
        if note not in notes:
            notes.append(note)
        return bound

    def per_token(b: int, c: int) -> float:  # seconds per committed token per stream, mean over the train rows
        if b == 1:
            return cost(1, c)
        return float(np.mean(cost(b, c) / tau_at(b)))

    measured = {int(c): float(s) for c, s in (k0_seconds or {}).items()}
    k0 = {int(c): "measured" if int(c) in measured else K0_ESTIMATE for c in loads}

    def k0_step(c: int) -> float:
        return measured[c] if c in measured else cost(2, c)

    out = Options([int(c) for c in sorted(loads)], {}, {}, k0)
    sched = {int(c): int(b) for c, b in schedule.items()}
    for name, b_at in ((PLAIN, lambda c: 1), (FIXED, lambda c: int(fixed_b)), (SCHEDULE, lambda c: sched[c])):
        out.k[name] = {c: b_at(c) - 1 for c in out.loads}
        out.tokens_per_s[name] = {}
        for c in out.loads:
            b = b_at(c)
            if name != PLAIN and b == 1:  # K = 0 inside a speculative server: the drafter still runs
                s = k0_step(c)
            else:
                s = per_token(b, c)
            out.tokens_per_s[name][c] = c / s
    out.notes = notes
    if int(fixed_b) == 1:  # a fixed b = 1 is plain vLLM, not a speculative server
        out.k.pop(FIXED), out.tokens_per_s.pop(FIXED)
    return out


def choose(o: Options, split_min_gain: float = SPLIT_MIN_GAIN) -> Options:
    """Sets ``chosen``, ``speculative``, ``serve``, ``regret`` and ``why`` (module docstring)."""
    names = [n for n in ORDER if n in o.tokens_per_s]
    best = {c: max(o.tokens_per_s[n][c] for n in names) for c in o.loads}
    o.regret = {n: max(1 - o.tokens_per_s[n][c] / best[c] for c in o.loads) for n in names}
    single = min(names, key=lambda n: (round(o.regret[n], 9), names.index(n)))  # ties to the simpler

    def fmt(c: int, n: str) -> str:
        return f"{o.tokens_per_s[n][c]:.0f} tok/s"

    if o.regret[single] <= split_min_gain:
        o.chosen = single
        o.speculative = None if single == PLAIN else single
        o.serve = {c: single for c in o.loads}
        o.why = (f"{single} is within {split_min_gain:.0%} of the fastest option at every load of the grid "
                 f"(its largest shortfall {o.regret[single]:.1%})" + ("" if single == PLAIN or single == SCHEDULE
                                                                      else "; one K is simpler than a schedule"))
        return o
    spec = [n for n in (FIXED, SCHEDULE) if n in names]
    plain_at = [c for c in o.loads if o.tokens_per_s[PLAIN][c] >= max(o.tokens_per_s[n][c] for n in spec)]
    if not plain_at or not spec:  # speculation wins everywhere (or there is none): the best single option
        o.chosen, o.speculative = single, (None if single == PLAIN else single)
        o.serve = {c: single for c in o.loads}
        o.why = f"{single} has the least largest shortfall against the fastest option ({o.regret[single]:.1%})"
        return o
    rest = [c for c in o.loads if c not in plain_at]
    pick = min(spec, key=lambda n: (max(1 - o.tokens_per_s[n][c] / best[c] for c in rest), spec.index(n)))
    o.chosen, o.speculative = SPLIT, pick
    o.serve = {c: PLAIN if c in plain_at else pick for c in o.loads}
    o.why = (f"no one server is within {split_min_gain:.0%} of the fastest at every load (the least largest "
             f"shortfall: {single}, {o.regret[single]:.1%}): plain vLLM is fastest at c in {plain_at} ("
             + ", ".join(f"c={c}: plain {fmt(c, PLAIN)} against {pick} {fmt(c, pick)}" for c in plain_at)
             + f"), {pick} at c in {rest}")
    return o


def apply_verdicts(o: Options, config_of: Callable[[str], Optional[str]],
                   verdicts: Dict[str, Dict[str, Any]]) -> Options:
    """Plain vLLM at the grid points where ``deploy --check-vllm`` measured the speculative configuration deploy
    serves there slower than plain beyond noise (stages.deploy_check writes ``verdicts``: {"c|config json": {"c",
    "config", "slower", "why"}}), as deploy takes tune's load check: measured, not modelled. ``config_of(option)``:
    the option's --speculative-config as JSON (None: plain). A verdict on another configuration is ignored. A load c
    covers the grid point at or below it (the range vLLM's schedule and the routing hold from there)."""
    for v in verdicts.values():
        if not v.get("slower"):
            continue
        c = int(v["c"])
        point = max((x for x in o.loads if x <= c), default=None)
        if point is None or o.serve.get(point) == PLAIN:
            continue
        if config_of(o.serve[point]) != v["config"]:
            continue
        o.serve[point] = PLAIN
        o.measured[point] = v["why"]
    if o.measured:
        spec = [c for c, n in o.serve.items() if n != PLAIN]
        o.chosen = SPLIT if spec else PLAIN
        o.speculative = o.speculative if spec else None
        o.why += ("; then measured by deploy --check-vllm: " + "; ".join(f"c={c}: {w}" for c, w in
                                                                         sorted(o.measured.items()))
                  + f", so plain vLLM serves c in {sorted(o.measured)}")
    return o


def lines(o: Options, spec_k: Callable[[str], str]) -> List[str]:
    """The table (one row per load: each option's K and expected tokens/s, what deploy serves) and the verdict.
    ``spec_k(option)``: how the option is written (e.g. "K=7", "the schedule")."""
    names = [n for n in ORDER if n in o.tokens_per_s]
    head = "| c | " + " | ".join(f"{n} ({spec_k(n)})" if n != PLAIN else n for n in names) + \
        " | deploys | speculative K = 0 priced as |"
    out = [head, "|---:|" + "---:|" * len(names) + "---|---|"]
    for c in o.loads:
        cells = []
        for n in names:
            k = o.k[n][c]
            cells.append(f"{o.tokens_per_s[n][c]:.0f}" + ("" if n == PLAIN else f" (K={k})")
                         + ("" if n == PLAIN else f" {o.ratio(c, n):.2f}x"))
        zero = any(o.k[n][c] == 0 for n in names if n != PLAIN)
        out.append(f"| {c} | " + " | ".join(cells) + f" | {o.serve[c]} | "
                   + (o.k0[c] if zero else "-") + " |")
    return out
