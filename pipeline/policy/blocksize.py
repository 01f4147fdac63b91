"""The BlockPilot policy: a model from the target's raw last-position prefill logits to a per-request action.

An action is a block size b (every step verifies the whole block) or, for a speed policy trained with
``train.rules``, a per-step verify rule at the label set's trace b_max (pipeline/policy/step_rules.py): the model
has one output per action, candidates first, then the rule actions (policy.json ``rule_actions``).

Two models: :class:`BlockSizeMLP` (the paper's: Linear(V, hidden) -> ReLU -> Dropout, then (n_layers - 1) x
[Linear(hidden, hidden) -> ReLU -> Dropout, residual], then Linear(hidden, |A|); Kaiming init for the hidden layers,
Xavier for the output layer, zero biases) and :class:`LinearPolicyModel` (one Linear(V, |A|), what a ridge fit
exports: pipeline/training/ridge.py). Exported as ``model.safetensors`` + ``policy.json``; loaded with
:meth:`BlockSizePolicy.from_pretrained`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.io.layout import POLICY_META, POLICY_WEIGHTS
from pipeline.policy.stats import paired_bootstrap

TRANSFORMS = ("none", "softmax", "log_softmax", "standardize")
# policy.json "score" of a speed policy: the MLP's outputs / score_scale estimate log(speed(b) / speed(fallback)),
# speed = tau(b) / cost(b). A classifier's outputs are class logits ("class_logits").
SPEED_SCORE = "log_speed_ratio"


class BlockSizeMLP(nn.Module):
    def __init__(self, vocab_size: int, num_classes: int, hidden: int = 2048, n_layers: int = 2,
                 dropout: float = 0.2):
        super().__init__()
        self.input = nn.Linear(vocab_size, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n_layers - 1))
        self.output = nn.Linear(hidden, num_classes)
        self.dropout = nn.Dropout(dropout)
        for layer in [self.input, *self.blocks]:
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        nn.init.xavier_uniform_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(F.relu(self.input(x)))
        for layer in self.blocks:
            h = h + self.dropout(F.relu(layer(h)))
        return self.output(h)


class LinearPolicyModel(nn.Module):
    """One linear layer from the logits to every action's score: a ridge regression's weights, standardisation
    folded in (pipeline/training/ridge.py). Named ``input`` like the MLP's first layer, so :meth:`BlockSizePolicy.fold`
    folds it through lm_head the same way (exactly: the whole model is that layer)."""

    def __init__(self, vocab_size: int, num_classes: int):
        super().__init__()
        self.input = nn.Linear(vocab_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.input(x)


def policy_model(arch: Dict[str, Any], vocab_size: int, num_outputs: int) -> nn.Module:
    """The model an exported policy's ``architecture`` names (an MLP when it names no kind: older exports)."""
    arch = dict(arch)
    if arch.pop("kind", "mlp") == "linear":
        return LinearPolicyModel(vocab_size, num_outputs)
    return BlockSizeMLP(vocab_size, num_outputs, **arch)


def model_architecture(model: nn.Module) -> Dict[str, Any]:
    if isinstance(model, LinearPolicyModel):
        return {"kind": "linear"}
    return {"kind": "mlp", "hidden": model.input.out_features, "n_layers": 1 + len(model.blocks),
            "dropout": model.dropout.p}


@dataclass(frozen=True)
class Action:
    """What the policy decides per request: decode at ``block_size``, every step verifying the whole block
    (``rule`` None), or draft ``block_size`` = b_max and verify what the per-step ``rule`` keeps."""

    block_size: int
    rule: Optional[str] = None

    @property
    def name(self) -> str:
        return f"b={self.block_size}" if self.rule is None else f"{self.rule}@{self.block_size}"


def policy_actions(candidates: Sequence[int], rule_actions: Optional[Sequence[Dict[str, Any]]] = None) -> List[Action]:
    """A policy's actions in output order: the candidates, then its rule actions (policy.json ``rule_actions``:
    ``{"rule", "max_block_size"}`` each)."""
    return [Action(int(b)) for b in candidates] + [Action(int(a["max_block_size"]), str(a["rule"]))
                                                  for a in rule_actions or []]


def train_chosen_block_size(info: Dict[str, Any]) -> int:
    """The train-chosen fixed b, from an exported policy's metadata (policy.json): the one fixed block size chosen
    on the label set's train split, which a speed policy answers as its fallback. Every comparison with "the fixed
    b" (tune, evaluate, report, run) and a fixed-b deployment use this one; the hindsight-best b on an evaluation set
    is something else and is never called by this name. Policies exported before every objective wrote
    ``fallback_block_size`` carry it as ``best_fixed_block_size``."""
    b = info.get("fallback_block_size")
    if b is None:
        b = info.get("best_fixed_block_size")
    if b is None:
        raise ValueError("the policy's metadata names no train-chosen fixed b (fallback_block_size)")
    return int(b)


def transform_inputs(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The ablation's input transforms; the paper's best (and our default) is the raw logits ("none")."""
    x = x.float()
    if kind == "none":
        return x
    if kind == "softmax":
        return torch.softmax(x, dim=-1)
    if kind == "log_softmax":
        return torch.log_softmax(x, dim=-1)
    if kind == "standardize":  # per row, so nothing needs to be stored with the policy
        return (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True).clamp_min(1e-6)
    raise ValueError(f"unknown input_transform {kind!r}; expected one of {', '.join(TRANSFORMS)}")


class BlockSizePolicy:
    """A trained policy: ``choose(logits) -> block size``."""

    def __init__(self, model: nn.Module, candidates: Sequence[int], vocab_size: int, input_transform: str = "none",
                 info: Optional[Dict[str, Any]] = None):
        self.model = model.eval()
        self.candidates = [int(b) for b in candidates]
        self.vocab_size = int(vocab_size)
        self.input_transform = input_transform
        self.info = dict(info or {})
        # One output per action: the candidates, then the rule actions (a speed policy with train.rules).
        self.actions = policy_actions(self.candidates, self.info.get("rule_actions"))
        if self.answers_ar:  # at a load where b*(c) = 1: one more action, no speculation, that the head does not score
            self.actions.append(Action(1))

    @property
    def answers_ar(self) -> bool:
        """True for a policy at a load where not speculating is the train-chosen b (b*(c) = 1, :meth:`at_load`): it
        answers b = 1 for every request. Its head has no output for b = 1 (it learnt the candidates' speeds relative
        to the c = 1 fallback, not any row's absolute speed), so it cannot tell which prompts would still gain from
        speculating there: every request decodes autoregressively, which is b*(c) itself."""
        return self.fallback_block_size == 1 and 1 not in self.candidates

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def reads_hidden(self) -> bool:
        """True for a folded policy: its input is the target's final hidden state, not the logits."""
        return self.info.get("input") == "hidden"

    def _check(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != self.vocab_size:
            what = "hidden states of width" if self.reads_hidden else "logits over a vocabulary of"
            raise ValueError(f"policy expects {what} {self.vocab_size}, got {logits.shape[-1]} (was it trained for "
                             "another target?)")
        return logits

    def fold(self, lm_head: nn.Linear) -> "BlockSizePolicy":
        """The same policy reading the target's final hidden state h (H values) instead of its logits (V values).

        On raw logits the first layer is linear in h: W1 (W_lm h + b_lm) + b1 = (W1 W_lm) h + (W1 b_lm + b1), so
        folding W_lm into W1 at export gives a first layer V/H times smaller (Qwen3-8B: 151,936 / 4,096 = 37x) and
        skips nothing the policy uses. Exact in real arithmetic; in floats the product is formed in float64. Only for
        ``input_transform="none"``: softmax and the other transforms are not linear in h.
        """
        import copy

        if self.reads_hidden:
            raise ValueError("this policy is folded already")
        if self.input_transform != "none":
            raise ValueError(f"only a policy on raw logits folds (input_transform 'none', not "
                             f"{self.input_transform!r}): the transform is not linear in the hidden state")
        w_lm = lm_head.weight.detach().double().cpu()
        if w_lm.shape[0] != self.vocab_size:
            raise ValueError(f"lm_head has {w_lm.shape[0]} outputs, the policy reads {self.vocab_size} logits")
        first = self.model.input
        w1, b1 = first.weight.detach().double().cpu(), first.bias.detach().double().cpu()
        bias = b1 if lm_head.bias is None else b1 + w1 @ lm_head.bias.detach().double().cpu()
        folded = copy.deepcopy(self.model).cpu()
        folded.input = nn.Linear(w_lm.shape[1], first.out_features)
        with torch.no_grad():
            folded.input.weight.copy_((w1 @ w_lm).float())
            folded.input.bias.copy_(bias.float())
        info = {**self.info, "input": "hidden", "folded_from_vocab_size": self.vocab_size}
        return BlockSizePolicy(folded.to(self.device), self.candidates, w_lm.shape[1], "none", info)

    @torch.inference_mode()
    def scores(self, logits: Union[torch.Tensor, np.ndarray]) -> torch.Tensor:
        x = torch.as_tensor(logits)
        x = self._check(x if x.dim() == 2 else x.reshape(1, -1))
        s = self.model(transform_inputs(x.to(self.device), self.input_transform))
        shift = self.info.get("score_shift")
        if shift is not None:  # at_load: a constant per action (None: an action left out at that load)
            s = s + torch.tensor([float("-inf") if v is None else v for v in shift], dtype=s.dtype, device=s.device)
        return s

    def at_load(self, c: int, fallback: Optional[int] = None) -> "BlockSizePolicy":
        """The policy at c streams decoding together (policy.json's ``load``, from a version-3 cost profile): the
        same model, each block size's score shifted by log(cost(b, 1) / cost(b, c)) (its speed target is log tau -
        log cost and at T = 0 tau does not depend on load, so the head at c is the head at 1 plus a constant per
        action), the fallback the train-chosen b at c (b = 1 included: then :attr:`answers_ar`), the same margin (a log speed ratio, the predictions' noise is
        the c = 1 head's). Rule actions are left out: a rule's seconds at c are not one constant per action (tune's
        rule at c covers per-step verify there). Itself at c = 1 or without a load part. ``fallback``: b*(c) as a
        measurement left it instead of the model's (tune's load check: 1 where speculating was not measured
        faster)."""
        load = (self.info.get("load") or {}).get(str(int(c)))
        if int(c) == 1 or load is None:
            return self
        b = load["block_size"] if fallback is None else int(fallback)
        info = {**self.info, "fallback_block_size": b, "score_shift": load["score_shift"], "at_concurrency": int(c)}
        return BlockSizePolicy(self.model, self.candidates, self.vocab_size, self.input_transform, info)

    @property
    def train_chosen_block_size(self) -> int:
        """See :func:`train_chosen_block_size`."""
        return train_chosen_block_size(self.info)

    @property
    def fallback_block_size(self) -> Optional[int]:
        """The best fixed b (chosen on the training split) that a speed policy answers unless it predicts a gain
        above ``margin``; None for a classifier (objective paper / hard / soft), which always takes its argmax."""
        b = self.info.get("fallback_block_size")
        return None if b is None or self.info.get("score") != SPEED_SCORE else int(b)

    @property
    def margin(self) -> Optional[float]:
        """Predicted gain (log speed ratio over the fallback) a choice must exceed; None = always the fallback."""
        m = self.info.get("margin")
        return None if m is None else float(m)

    def predicted_gain(self, scores: torch.Tensor) -> torch.Tensor:
        """Per row: the best candidate's predicted log speed ratio over the fallback's (speed policies)."""
        f = self.candidates.index(self.fallback_block_size)
        scale = float(self.info.get("score_scale", 1.0))
        return (scores.max(dim=-1).values - scores[:, f]) * scale

    def decide(self, scores: torch.Tensor, min_gain: float = 0.0) -> List[int]:
        """Candidate indices from scores [N, |C|]: the argmax, or for a speed policy the fallback unless the
        predicted gain exceeds the margin and ``min_gain`` (a log speed ratio over the fallback b: what the
        fallback deployment is expected to gain over plain decoding at the fallback b, e.g. a per-step rule's,
        see :class:`pipeline.decoding.adaptive.AdaptiveDecoder`)."""
        best = scores.argmax(dim=-1)
        if self.fallback_block_size is None:
            return best.tolist()
        if self.answers_ar:
            return [len(self.actions) - 1] * scores.shape[0]
        f = self.candidates.index(self.fallback_block_size)
        if self.margin is None:
            return [f] * scores.shape[0]
        take = self.predicted_gain(scores) > max(self.margin, min_gain)
        return torch.where(take, best, torch.full_like(best, f)).tolist()

    def choose_action(self, logits: Union[torch.Tensor, np.ndarray], min_gain: float = 0.0) -> Action:
        """The action for one prompt, from its raw last-position prefill logits [V] (a folded policy: the final
        hidden state [H])."""
        return self.actions[self.decide(self.scores(logits), min_gain)[0]]

    def choose(self, logits: Union[torch.Tensor, np.ndarray], min_gain: float = 0.0) -> int:
        """The block size for one prompt (a rule action's b_max): :meth:`choose_action`'s."""
        return self.choose_action(logits, min_gain).block_size

    def choose_actions(self, logits, min_gain: float = 0.0) -> List[Action]:
        """The action for each prompt of a batch of logits [N, V]."""
        return [self.actions[i] for i in self.decide(self.scores(logits), min_gain)]

    def choose_batch(self, logits, min_gain: float = 0.0) -> List[int]:
        return [a.block_size for a in self.choose_actions(logits, min_gain)]

    def save_pretrained(self, folder: Union[str, Path]) -> None:
        from safetensors.torch import save

        from pipeline.io.storage import location, write_bytes_atomic

        folder = location(folder)  # a local folder or object storage
        folder.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(save({k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}),
                           folder / POLICY_WEIGHTS)
        meta = {"candidates": self.candidates, "vocab_size": self.vocab_size,
                "input_transform": self.input_transform, "architecture": model_architecture(self.model), **self.info}
        write_bytes_atomic((json.dumps(meta, indent=2, default=str) + "\n").encode(), folder / POLICY_META)

    @classmethod
    def from_pretrained(cls, folder: Union[str, Path], device: Union[str, torch.device] = "cpu") -> "BlockSizePolicy":
        from safetensors.torch import load

        from pipeline.io.storage import location

        folder = location(folder)
        if not (folder / POLICY_META).is_file() or not (folder / POLICY_WEIGHTS).is_file():
            raise FileNotFoundError(f"{folder} is not an exported policy (needs {POLICY_META} and {POLICY_WEIGHTS})")
        meta = json.loads((folder / POLICY_META).read_text())
        outputs = len(meta["candidates"]) + len(meta.get("rule_actions") or [])
        model = policy_model(meta.get("architecture", {}), meta["vocab_size"], outputs)
        model.load_state_dict(load((folder / POLICY_WEIGHTS).read_bytes()))
        info = {k: v for k, v in meta.items() if k not in ("candidates", "vocab_size", "input_transform", "architecture")}
        return cls(model.to(device), meta["candidates"], meta["vocab_size"], meta.get("input_transform", "none"), info)


def _unit(prompt_id: str) -> float:
    import hashlib

    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) / 2**32


def is_val(prompt_id: str, val_fraction: float) -> bool:
    """Deterministic train/val split by a hash of prompt_id (stable across runs, machines and shard layouts)."""
    return _unit(prompt_id) < val_fraction


def split_of(prompt_id: str, val_fraction: float, calibration_fraction: float = 0.0) -> str:
    """"val" (as :func:`is_val`), "calib" (the next ``calibration_fraction`` of the hash range: where the fallback
    margin is calibrated) or "train"."""
    u = _unit(prompt_id)
    return "val" if u < val_fraction else "calib" if u < val_fraction + calibration_fraction else "train"


def speed_targets(tau: np.ndarray, costs: np.ndarray, fallback_index: int) -> np.ndarray:
    """log(speed(b) / speed(fallback)) per row and candidate, speed = tau / cost (tokens per second)."""
    logspeed = np.log(np.maximum(tau, 1e-6)) - np.log(costs)[None, :]
    return logspeed - logspeed[:, fallback_index:fallback_index + 1]


def speed_gain(tau: np.ndarray, costs: np.ndarray, chosen: np.ndarray, baseline: np.ndarray) -> float:
    """Modelled gain of the chosen candidates over the baseline ones: mean time per token (cost / tau) of the
    baseline / the chosen's, minus 1 (the ratio of means evaluate's speedups use)."""
    rows = np.arange(len(tau))
    t = costs[None, :] / np.maximum(tau, 1e-6)
    return float(t[rows, baseline].mean() / t[rows, chosen].mean() - 1) if len(tau) else 0.0


def calibrate_margin(gain_pred: np.ndarray, best: np.ndarray, tau: np.ndarray, costs: np.ndarray,
                     fallback_index: int, reps: int = 1000, seed: int = 0) -> Dict[str, Any]:
    """The margin on predicted gain that maximises the modelled gain over always-fallback on held-out rows: one
    threshold between each two neighbouring distinct predicted gains, and one below them all (switch where the
    prediction is strictly above it). None when no threshold gains, or when the best one's gain is not above zero at
    its lower 5 % bootstrap bound (the policy then always answers the fallback)."""
    fb = np.full(len(tau), fallback_index)
    best_m, best_g, switched = None, 0.0, 0
    # Ascending thresholds, the first switching every row the model prefers; on a tie the larger margin wins
    # (fewer switches for the same held-out gain). Midway between predictions, not at one: a margin equal to a
    # calibration row's own prediction decided that row by the last bit, which the same logits scored in another
    # batch shape or precision (serving, a test's recomputation) could flip.
    u = np.unique(np.asarray(gain_pred, dtype=np.float64))
    thresholds = []
    if len(u):
        below = u[0] - (0.5 * (u[1] - u[0]) if len(u) > 1 else max(abs(float(u[0])), 1e-6))
        thresholds = [float(below), *((u[:-1] + u[1:]) / 2).tolist()]
    for m in thresholds:
        chosen = np.where(gain_pred > m, best, fb)
        g = speed_gain(tau, costs, chosen, fb)
        if g > 1e-12 and g >= best_g - 1e-12:
            best_m, best_g, switched = float(m), max(g, best_g), int((chosen != fb).sum())
    # A gain the calibration rows cannot tell from zero is not worth the risk: with the chosen margin, resample the
    # rows (paired bootstrap); unless the gain's lower 5 % bound is above zero, always answer the fallback.
    lower = None
    if best_m is not None:
        chosen = np.where(gain_pred > best_m, best, fb)
        t = costs[None, :] / np.maximum(tau, 1e-6)
        rows = np.arange(len(tau))
        lower = paired_bootstrap(lambda t_fb, t_ch: t_fb / t_ch - 1, t[rows, fb], t[rows, chosen], reps=reps,
                                 seed=seed, level=0.90)[0]  # the low end of the central 90 %: the lower 5 % bound
    out = {"margin": best_m, "calibration_gain": best_g, "calibration_switched": switched,
           "calibration_rows": int(len(tau)), "calibration_gain_lower5": lower}
    if best_m is not None and not lower > 0:
        out.update(margin=None, rejected_margin=best_m, why="the calibration gain's lower 5 % bootstrap bound is "
                   "not above zero: always the fallback")
    return out


def choice_metrics(scores: torch.Tensor, label_index: np.ndarray, tau: np.ndarray, fixed_index: int,
                   trained_index: int) -> Dict[str, float]:
    """How good the policy's choices are: accuracy, top-2 accuracy, and the mean tau it buys vs baselines.

    tau: [N, |C|] measured tau per candidate. fixed_index: the single best fixed candidate (chosen on the TRAIN
    split); trained_index: the draft's trained B. regret = oracle - policy.
    """
    n = len(label_index)
    if n == 0:
        return {}
    pred = scores.argmax(dim=-1).cpu().numpy()
    top2 = scores.topk(min(2, scores.shape[-1]), dim=-1).indices.cpu().numpy()
    rows = np.arange(n)
    tau_policy = float(tau[rows, pred].mean())
    tau_oracle = float(tau.max(axis=1).mean())
    return {
        "accuracy": float((pred == label_index).mean()),
        "top2_accuracy": float((top2 == label_index[:, None]).any(axis=1).mean()),
        "tau_policy": tau_policy, "tau_trained_b": float(tau[:, trained_index].mean()),
        "tau_best_fixed": float(tau[:, fixed_index].mean()), "tau_oracle": tau_oracle,
        "regret": tau_oracle - tau_policy,
    }
