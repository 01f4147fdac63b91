"""A label worker's cost profile, measured once per device kind and shared through output_dir (issue #51).

Each label worker used to time the whole profile at start-up (b = 1..2B at each context length, a few rounds, and the
load grid): 64 identical GPUs measured the same thing 64 times. With sharing on, the workers of one kind (the same
device and dtype, GPU model, CUDA build, compile setting, models, candidates and profile settings: :func:`kind_key`)
meet at ``output_dir/.profiles/<key>.json``:

* the first to create ``<key>.claim`` (an exclusive create, :mod:`pipeline.io.exclusive`: a hard link on a disk,
  ``If-None-Match`` on S3) measures the profile and publishes it (an atomic write);
* the others wait for it, then time a short check of their own (b = 1 and B, one round at the first context
  length) and reuse the shared profile; one whose own step times differ from it by more than
  ``profile.share_tolerance`` says so in the log, with both figures, and keeps the shared one (the labels of one set
  then rank the candidates by one cost model);
* a worker that waited ``workers.check_timeout_s`` without a profile (its measurer died) measures its own; a rerun
  starts by clearing the claims an earlier run left unfinished (:func:`clear_unfinished_claims`, the label driver's,
  with the folder's lease held and no worker started).

Sharing is on where the models run on GPUs (``profile.share: auto``): each GPU is its own device, so one measures
for all. On CPUs the workers of a host share its cores, and each step of one is slowed by the others' work; each
measures its own, under the contention it labels under (``profile.share: on`` shares there too, as the tests do).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable, Dict, Optional, Tuple

from pipeline.policy.cost import CostProfile

POLL_S = 0.5


def sharing(share: str, device_type: str) -> bool:
    """``profile.share`` (auto | on | off) resolved for a worker whose models are on ``device_type``."""
    return share == "on" or (share == "auto" and device_type == "cuda")


def kind_key(kind: Dict[str, Any]) -> str:
    """The file name's key: a digest of everything that makes two workers' profiles the same measurement."""
    return hashlib.sha256(json.dumps(kind, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shared_profile(output_dir: str, kind: Dict[str, Any], measure: Callable[[], CostProfile],
                   check: Callable[[], CostProfile], tolerance: float, wait_s: float,
                   say: Callable[[str], None]) -> Tuple[CostProfile, Dict[str, Any]]:
    """(the profile this worker labels with, how it got it: ``{"shared": "measured" | "reused" | "own",
    "key": ..., and for a reuse the check's ratios}``)."""
    from pipeline.io.exclusive import exclusive_file
    from pipeline.io.shards import write_text_atomic
    from pipeline.io.storage import location

    key = kind_key(kind)
    folder = location(output_dir) / ".profiles"
    folder.mkdir(parents=True, exist_ok=True)
    done, claim = folder / f"{key}.json", folder / f"{key}.claim"
    found = _read(done)
    if found is None and exclusive_file(claim, f".{key}.lock").create(json.dumps(kind).encode()) is not None:
        profile = measure()
        write_text_atomic(json.dumps(profile.to_dict()) + "\n", done)
        return profile, {"shared": "measured", "key": key}
    deadline = time.monotonic() + wait_s
    while found is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
        found = _read(done)
    if found is None:
        say(f"no shared cost profile at {done} after {wait_s:g} s (workers.check_timeout_s; its measurer may have "
            "died): measuring this worker's own")
        return measure(), {"shared": "own", "key": key}
    mine = check()
    ratios = {b: mine.seconds[b] / found.seconds[b] for b in mine.seconds if found.seconds.get(b)}
    worst = max(ratios.values(), key=lambda r: abs(r - 1.0)) if ratios else 1.0
    if abs(worst - 1.0) > tolerance:
        say("its own step times differ from the shared cost profile's by more than profile.share_tolerance="
            f"{tolerance:g}: " + ", ".join(f"b={b} {mine.seconds[b] * 1e3:.2f} ms against "
                                          f"{found.seconds[b] * 1e3:.2f} ms" for b in sorted(ratios))
            + f" ({done}); labelling with the shared one")
    return found, {"shared": "reused", "key": key, "check_ratio": {str(b): round(r, 4) for b, r in ratios.items()}}


def clear_unfinished_claims(output_dir: str) -> int:
    """Delete every claim under ``output_dir/.profiles`` without its profile; how many. Safe only before this run's
    workers start (the label driver, under the folder's lease)."""
    from pipeline.io.storage import location

    folder = location(output_dir) / ".profiles"
    if not folder.exists():
        return 0
    cleared = 0
    for claim in folder.glob("*.claim"):
        if not (folder / (claim.name[:-len(".claim")] + ".json")).exists():
            claim.unlink()
            cleared += 1
    return cleared


def _read(path) -> Optional[CostProfile]:
    try:
        return CostProfile.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
