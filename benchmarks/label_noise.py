"""How much of a T > 0 label is noise: the per-prompt best block size by three estimators against a reference.

For each of N bundled label prompts and each candidate b, R sampled decodes (the bundled tiny pair, batch-1 engine).
The reference speed of b is the mean tau of decodes r+1..R over cost(b); the estimators see only decodes 1..r:

* one draw (the paper's label): tau of decode 1;
* expected: tau_expected of decode 1 (each step's acceptance draws integrated out, pipeline.decoding.expected);
* mean of r draws: the mean tau of decodes 1..r.

Each estimator's label is argmax_b of its tau / cost(b). Printed: how often it picks the reference's best b, its
regret (the reference speed of the best b over that of the label's b, minus 1, mean over prompts), and the spread of
one decode's tau and tau_expected around the reference mean.

    python benchmarks/label_noise.py --prompts 200 --draws 16 --jobs 2 --cost-profile runs/default/labels/cost_profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def label_prompts(tokenizer, n: int, max_tokens: int, split: str = "label"):
    """The first n / 5 prompts of each bundled kind's ``split`` (label or eval), tokenized without the chat template,
    cut to max_tokens (n in all)."""
    from pipeline.data.bundled import PROMPTS_DIR

    kinds = ("code", "docs", "bible", "fortunes", "maths")
    out = []
    for kind in kinds:
        with open(PROMPTS_DIR / f"{kind}-{split}.jsonl") as f:
            out += [tokenizer(json.loads(line)["text"])["input_ids"][:max_tokens]
                    for _, line in zip(range(-(-n // len(kinds))), f)]
    return out[:n]


def measure(job: int, prompts, cands, a):
    """tau and tau_expected [prompt, b, draw] of ``prompts`` (one process, one thread)."""
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    torch.manual_seed(job)
    m = load_models(load_config([]).model)
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    tau = np.zeros((len(prompts), len(cands), a.draws))
    exp = np.zeros_like(tau)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        state = engine.prefill(torch.tensor([p]))
        for j, b in enumerate(cands):
            for k in range(a.draws):
                d = engine.decode(state, block_size=b, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                  seed=None)
                tau[i, j, k], exp[i, j, k] = d.tau, d.tau_expected
        print(f"[job {job}] prompt {i + 1}/{len(prompts)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return tau, exp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=45)
    ap.add_argument("--draws", type=int, default=16, help="R sampled decodes per prompt and b")
    ap.add_argument("--estimator-draws", type=int, default=4, help="r: the draws the estimators may read")
    ap.add_argument("--candidates", default="4,5,6,7,8,9,10,11,12")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--cost-profile", default="runs/default/labels/cost_profile.json")
    ap.add_argument("--jobs", type=int, default=1, help="processes, one thread each (one per core)")
    a = ap.parse_args(argv)
    from pipeline.decoding.models import load_models
    from pipeline.policy.cost import CostProfile
    from pipeline.runtime.config import load_config

    cands = [int(b) for b in a.candidates.split(",")]
    cost = np.array([CostProfile.load(a.cost_profile).cost(b) for b in cands])
    prompts = label_prompts(load_models(load_config([]).model).tokenizer, a.prompts, 256)
    r = a.estimator_draws
    t0 = time.perf_counter()
    chunks = [(k, prompts[k::a.jobs], cands, a) for k in range(a.jobs)]
    if a.jobs == 1:
        parts = [measure(*chunks[0])]
    else:  # one process per core, one thread each: the prompts dealt round-robin
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(a.jobs) as pool:
            parts = pool.starmap(measure, chunks)
    tau, exp = (np.zeros((len(prompts), len(cands), a.draws)) for _ in range(2))
    for k, (t, e) in enumerate(parts):
        tau[k::a.jobs], exp[k::a.jobs] = t, e
    ref = tau[:, :, r:].mean(-1) / cost  # reference speed per (prompt, b)
    best = ref.argmax(1)
    rows = {"one draw (the paper's label)": tau[:, :, 0], "expected (tau_expected of one decode)": exp[:, :, 0],
            f"mean of {r} draws": tau[:, :, :r].mean(-1)}
    n = np.arange(len(prompts))
    print(f"\nT = {a.temperature}, {len(prompts)} prompts x {len(cands)} b x {a.draws} decodes of "
          f"{a.max_new_tokens} tokens; reference: the mean tau of draws {r + 1}..{a.draws}; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"reference mean tau per b: " + " ".join(f"{b}:{v:.3f}" for b, v in zip(cands, tau.mean((0, 2)))))
    print(f"{'estimator':<40} {'best b agrees [95 % CI]':>26} {'regret in speed [95 % CI]':>28} "
          f"{'sd around the reference tau':>28}")
    ref_tau = tau[:, :, r:].mean(-1)
    boot = np.random.default_rng(0).integers(0, len(prompts), (2000, len(prompts)))  # prompts resampled

    def ci(per_prompt):
        v = per_prompt[boot].mean(1)
        return np.percentile(v, 2.5), np.percentile(v, 97.5)

    hits, losses = {}, {}
    for name, est in rows.items():
        pick = (est / cost).argmax(1)
        hits[name], losses[name] = (pick == best).astype(float), ref[n, best] / ref[n, pick] - 1
        (alo, ahi), (rlo, rhi) = ci(hits[name]), ci(losses[name])
        spread = float(np.sqrt(((est - ref_tau) ** 2).mean()))
        print(f"{name:<40} {hits[name].mean():>7.1%} [{alo:>6.1%}, {ahi:>6.1%}] "
              f"{losses[name].mean():>+9.2%} [{rlo:>+6.2%}, {rhi:>+6.2%}] {spread:>20.3f}")
    print(f"{'(the reference against itself, halves)':<40} "
          f"{float(((tau[:, :, r::2].mean(-1) / cost).argmax(1) == (tau[:, :, r + 1::2].mean(-1) / cost).argmax(1)).mean()):>7.1%}")
    one, expd = list(rows)[:2]  # paired over prompts: what the expected label changes against one draw
    (alo, ahi), (rlo, rhi) = ci(hits[expd] - hits[one]), ci(losses[expd] - losses[one])
    print(f"expected - one draw, paired: agreement {(hits[expd] - hits[one]).mean():+.1%} [{alo:+.1%}, {ahi:+.1%}], "
          f"regret {(losses[expd] - losses[one]).mean():+.2%} [{rlo:+.2%}, {rhi:+.2%}]")

if __name__ == "__main__":
    main()
