"""Output quality at T > 0: is every generated token distributed as the target's own sampling distribution?

At T = 0 a method is checked token for token against the target's greedy output. At T > 0 outputs are draws, so
the check is by distribution, and it can be exact: the target's sampling distribution p_t(. | prompt, y_<t) at
every generated position t is one forward pass over prompt + output away. The randomized probability integral
transform of each generated token y_t,

    u_t = F_t(y_t - 1) + v_t * p_t(y_t),   F_t the cumulative of p_t in token-id order, v_t ~ U(0, 1),

is exactly Uniform(0, 1) and independent over t when every y_t ~ p_t (the discrete Rosenblatt transform), whatever
the prompt, the position or the block structure. Pooled over a method's outputs, u is tested for uniformity with a
chi-square over equal bins. A sampler that is not exact (one that accepts every drafted token, a wrong residual,
a temperature applied twice) moves mass between bins; tests/unit/test_distribution_check.py shows the engine
passing and a sampler accepting every drafted token failing.

This checks each token against the target's conditional at the prefix the method itself produced, which is what
losslessness means; it is stronger than comparing a method's per-position token histograms with the target's own
sampled outputs (the same prompts' draws diverge after a few tokens, so those histograms compare little).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np
import torch

# A method fails the check below this p-value. With ~12 methods per evaluation a false alarm on an exact sampler
# happens about once in 80 evaluations; a sampler accepting every drafted token of the tiny pair scores p < 1e-12.
ALPHA = 0.001
BINS = 20


@torch.inference_mode()
def pit_values(target, output_ids: torch.Tensor, num_input_tokens: int, temperature: float, top_p: float,
               top_k: int, seed: int = 0) -> np.ndarray:
    """The randomized PIT u_t of every generated token of ``output_ids`` ([1, n + new], prompt included) under the
    target's sampling distribution (temperature, top_p, top_k as the engine samples); [new] float32."""
    from dflash.model import _sampling_probs

    n, total = int(num_input_tokens), int(output_ids.shape[1])
    if total <= n:
        return np.zeros(0, dtype=np.float32)
    ids = output_ids.to(target.device)
    logits = target(ids[:, :total - 1], logits_to_keep=total - n).logits  # positions n-1 .. total-2
    p = _sampling_probs(logits.float(), temperature, top_p, top_k)[0]  # [new, V]
    y = ids[0, n:].long()[:, None]
    p_y = p.gather(-1, y)[:, 0]
    below = p.cumsum(-1).gather(-1, y)[:, 0] - p_y
    v = torch.rand(p_y.shape, generator=torch.Generator().manual_seed(int(seed))).to(p_y.device)
    return (below + v * p_y).clamp(0.0, 1.0).cpu().numpy().astype(np.float32)


def uniformity(u: Sequence[float], bins: int = BINS) -> Dict[str, Any]:
    """Chi-square test of ``u`` against Uniform(0, 1) over ``bins`` equal bins: {tokens, chi2, p_value, passes,
    histogram (the share of u per bin, 1/bins each when uniform)}. p_value None below 5 expected per bin."""
    u = np.asarray(u, dtype=np.float64)
    n = int(u.size)
    counts = np.bincount(np.minimum((u * bins).astype(np.int64), bins - 1), minlength=bins) if n else np.zeros(bins)
    if n < 5 * bins:
        return {"tokens": n, "chi2": None, "p_value": None, "passes": None,
                "histogram": (counts / max(n, 1)).round(4).tolist()}
    expected = n / bins
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # P(chi2_{bins-1} >= chi2): the regularized upper incomplete gamma Q((bins-1)/2, chi2/2).
    p = float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64)))
    return {"tokens": n, "chi2": chi2, "p_value": p, "passes": p >= ALPHA, "histogram": (counts / n).round(4).tolist()}


def distribution_summary(results, methods: Sequence[str]) -> Dict[str, Any]:
    """summary.json's ``distribution``: per method, :func:`uniformity` of every ``pit`` value of its rows, and
    ``all_pass``; {} at T = 0 (no row has values)."""
    per: Dict[str, list] = {}
    for m, pit in zip(results.column("method").to_pylist(), results.column("pit").to_pylist()):
        if pit is not None:
            per.setdefault(m, []).extend(pit)
    if not per:
        return {}
    out = {m: uniformity(per[m]) for m in methods if m in per}
    return {"alpha": ALPHA, "bins": BINS, "methods": out,
            "all_pass": all(v["passes"] is not False for v in out.values()),
            "failing": [m for m, v in out.items() if v["passes"] is False]}
