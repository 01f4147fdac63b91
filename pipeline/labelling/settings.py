"""Label settings every worker and the driver agree on, decided from the config and the draft's config before any
model is loaded: the trained block size B, the trace's b_max and the labelling mode."""

from __future__ import annotations

from pipeline.runtime.config import ConfigError, PipelineConfig
from pipeline.runtime.log import get as log


def trained_block_size(cfg: PipelineConfig) -> int:
    """B: label.block_size, else the draft's config (read without loading weights)."""
    if cfg.label.block_size:
        return int(cfg.label.block_size)
    from dflash.model import _draft_value

    from pipeline.decoding.models import draft_config

    return int(_draft_value(draft_config(cfg.model), "block_size", 16))


def trace_block_size(cfg: PipelineConfig) -> int:
    """b_max of the per-step trace (and of tune's rules): label.trace_block_size, else B + B // 4."""
    B = trained_block_size(cfg)
    return int(cfg.label.trace_block_size or max(2, B + B // 4))


def resolve_mode(cfg: PipelineConfig) -> str:
    """auto = replay at T = 0 when replay is proven exact for the draft (and much cheaper), exhaustive otherwise.
    Decided from the draft's config, before any model is loaded; label.mode=replay with a draft replay does not
    model fails here."""
    if cfg.label.mode == "exhaustive" or (cfg.label.mode == "auto" and cfg.decode.temperature > 0):
        return "exhaustive"
    from pipeline.decoding.models import ModelNotFound, draft_config
    from pipeline.labelling.replay import replay_unsupported_config

    try:
        why = replay_unsupported_config(draft_config(cfg.model))
    except ModelNotFound:  # no draft there at all: said in one line naming model.draft, not worked around
        raise
    except Exception as e:  # noqa: BLE001 - a config that cannot be read cannot be proven exact either
        why = f"an unreadable draft config ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    if why is None:
        return "replay"
    if cfg.label.mode == "replay":
        raise ConfigError(f"config key 'label.mode': replay does not model {why} (draft {cfg.model.draft!r}); "
                          "use label.mode=exhaustive or auto")
    log("label").info(f"mode auto: exhaustive, because replay does not model {why}")
    return "exhaustive"
