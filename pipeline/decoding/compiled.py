"""``engine.compile``: the target's and the draft's forwards through ``torch.compile``, or eager (the reference).

What is compiled: the target's decoder stack (``target.model.forward``: the verify, prefill and one-token greedy
steps of every engine, the batched one's included; the lm_head stays eager) and the draft's ``forward`` (the batch-1
engine's block forward; the batched engine runs the draft's layers written out, eager), with dynamic shapes: a
graph serves every block size, batch and cache length but the sizes 1 that dynamo specialises, so a run does not
recompile per b, c or width (on this CPU a random 3-layer pair's batch-1 and batched decodes over b in 1..8 built
8 graphs with duck shapes off, below; benchmarks/results/compile-shapes.md). The engine loops around them
(acceptance, cache crops, the batched engine's bookkeeping) stay Python.

What is not: CUDA graphs (``mode="reduce-overhead"``). The engines hold a forward's outputs across the next forward
(the draft's context features, replay's kept features), which a replayed graph would overwrite; a static-cache
engine with one host sync per step (issue #45, point 1) is the change that would allow them, and it is not built.

``auto``: eager on CPU, where it was measured not to repay its compile within a run (the tiny pair's batch-1 step
at b = 8: 0.83-0.94x for 38-49 s of compile; labelling a batch of 64: 0.88x for 25 s more;
benchmarks/results/engine-compile.md); compiled on CUDA, where a step is mostly launch overhead. The CUDA figure is
not measured here (no GPU): ``benchmarks/gpu_check.sh`` times both. A compile that fails falls back to eager, said
once in the log.
"""

from __future__ import annotations

import functools

import torch
import torch.fx.experimental._config as shapes

from pipeline.runtime.checks import COMPILE_MODES
from pipeline.runtime.log import get as log


def wants_compile(mode: str, device_type: str) -> bool:
    if mode not in COMPILE_MODES:
        raise ValueError(f"engine.compile must be one of {COMPILE_MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device_type == "cuda")


# Duck shapes off while a compiled forward traces: by default dynamo gives sizes that are equal when it traces (a
# one-token query against a one-slot cache, a block as long as the cache) one symbol, and the next call where they
# differ fails that guard and recompiles. On the tiny pair's batch-1 and batched decodes over every b (the test in
# tests/integration/test_compiled.py) that was 12 graphs and 109 CPU-s of compile; without, 8 graphs and 70 CPU-s,
# tokens equal (benchmarks/compile_shapes.py, which also times the compiled step both ways). Set per call, not
# process-wide: other code in the process (vLLM's own compile) keeps torch's default.
DUCK_SHAPES = False


def compile_forward(module: torch.nn.Module, name: str) -> None:
    """Replace ``module.forward`` by its compiled form; a compiler failure (not an error of the model's own, which
    raises as in eager) switches the module back to eager for good, logged once. ``forward.blockpilot_compile``
    counts the calls that went through the compiled function and says whether it fell back (:func:`compile_state`)."""
    eager = module.forward
    compiled = torch.compile(eager, dynamic=True)
    state = {"fn": compiled, "compiled_calls": 0, "eager_calls": 0, "fallback": None}

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        if _filling(kwargs.get("past_key_values")):
            state["eager_calls"] += 1
            return eager(*args, **kwargs)
        duck, shapes.use_duck_shape = shapes.use_duck_shape, DUCK_SHAPES  # for this call's tracing alone
        try:
            out = state["fn"](*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:  # noqa: SLF001 - dynamo's own error base
            if state["fn"] is eager:
                raise
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log("engine").warning(f"engine.compile: {name} could not be compiled ({reason}); running it eager")
            state["fn"], state["fallback"] = eager, reason
            state["eager_calls"] += 1
            return eager(*args, **kwargs)
        finally:
            shapes.use_duck_shape = duck
        state["compiled_calls" if state["fn"] is compiled else "eager_calls"] += 1
        return out

    forward.blockpilot_compiled = True
    forward.blockpilot_compile = state
    module.forward = forward


def compile_state(module: torch.nn.Module) -> dict:
    """How a module's forward ran since :func:`compile_forward`: ``compiled_calls``, ``eager_calls`` (cache-filling
    forwards, and every call after a fallback) and ``fallback`` (the compiler's error, or None)."""
    state = getattr(module.forward, "blockpilot_compile", None)
    if state is None:
        raise ValueError("this module's forward is not compiled by engine.compile")
    return {k: v for k, v in state.items() if k != "fn"}


def _filling(cache) -> bool:
    """A forward that creates its cache's layers (a prefill into a fresh DynamicCache, a draft's first block) runs
    eager: each layer's lazy initialisation is a guard of its own, and at 10 layers the recompiles ran past dynamo's
    limit of 8 (measured with gpu_label_costs.py --smoke --compile). It is one forward per prompt, and work-bound."""
    layers = getattr(cache, "layers", None)
    return layers is not None and (not layers or not all(getattr(x, "is_initialized", True) for x in layers))


def apply_compile(models, mode: str) -> bool:
    """Compile the target's and the draft's forwards when ``mode`` asks for it on their device; True if it did.
    Idempotent (models already compiled are left as they are)."""
    if not wants_compile(mode, models.target.device.type):
        return False
    for name, module in (("target", models.target.model), ("draft", models.draft)):
        if not getattr(module.forward, "blockpilot_compiled", False):
            compile_forward(module, name)
    return True
