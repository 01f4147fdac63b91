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
* the measurer beats while it measures (``<key>.beat.<n>`` rewritten every :data:`BEAT_S`), and the others wait as
  long as it beats, however long the profile takes (a fixed wait made 63 workers of 64 each measure their own once
  a profile took longer than it); a claim whose beat stops for :data:`STALE_S` (its measurer died, or was given up
  on by the pool's setup deadline) is taken over at once by one of them (the exclusive create of
  ``<key>.claim.<n+1>``), which measures and publishes for the rest; a rerun starts by clearing the claims an earlier
  run left unfinished (:func:`clear_unfinished_claims`, the label driver's, with the folder's lease held and no
  worker started).

Sharing is on where the models run on GPUs (``profile.share: auto``): each GPU is its own device, so one measures
for all. On CPUs the workers of a host share its cores, and each step of one is slowed by the others' work; each
measures its own, under the contention it labels under (``profile.share: on`` shares there too, as the tests do).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Optional, Tuple

from pipeline.policy.cost import CostProfile

POLL_S = 0.5
BEAT_S = 5.0  # how often the measurer rewrites its beat
# A beat unchanged this long means its measurer is gone: six beats, so that a slow write to object storage or a
# garbage collection is not taken for a death, and a dead measurer costs the others half a minute, not the profile.
STALE_S = 30.0


def sharing(share: str, device_type: str) -> bool:
    """``profile.share`` (auto | on | off) resolved for a worker whose models are on ``device_type``."""
    return share == "on" or (share == "auto" and device_type == "cuda")


def kind_key(kind: Dict[str, Any]) -> str:
    """The file name's key: a digest of everything that makes two workers' profiles the same measurement."""
    return hashlib.sha256(json.dumps(kind, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shared_profile(output_dir: str, kind: Dict[str, Any], measure: Callable[[], CostProfile],
                   check: Callable[[], CostProfile], tolerance: float, say: Callable[[str], None],
                   stale_s: float = STALE_S, beat_s: float = BEAT_S) -> Tuple[CostProfile, Dict[str, Any]]:
    """(the profile this worker labels with, how it got it: ``{"shared": "measured" | "reused", "key": ...,
    "generation": the claim it measured under (0 the first, more after takeovers), and for a reuse the check's
    ratios}``)."""
    from pipeline.io.exclusive import exclusive_file
    from pipeline.io.shards import write_text_atomic
    from pipeline.io.storage import location

    key = kind_key(kind)
    folder = location(output_dir) / ".profiles"
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / f"{key}.json"
    generation = 0
    found = _read(done)
    while found is None:
        claim = folder / (f"{key}.claim" + (f".{generation}" if generation else ""))
        if exclusive_file(claim, f".{key}.{generation}.lock").create(json.dumps(kind).encode()) is not None:
            beat = folder / f"{key}.beat.{generation}"
            with _beating(beat, beat_s):
                profile = measure()
            write_text_atomic(json.dumps(profile.to_dict()) + "\n", done)
            beat.unlink(missing_ok=True)  # the profile is there: nobody reads the beat again
            return profile, {"shared": "measured", "key": key, "generation": generation}
        found = _wait(done, folder / f"{key}.beat.{generation}", stale_s)
        if found is None:
            say(f"the worker measuring the shared cost profile ({claim}) gave no sign of progress for {stale_s:g} s "
                "(it died, or was given up on): taking its claim over")
            generation += 1
    mine = check()
    ratios = {b: mine.seconds[b] / found.seconds[b] for b in mine.seconds if found.seconds.get(b)}
    worst = max(ratios.values(), key=lambda r: abs(r - 1.0)) if ratios else 1.0
    if abs(worst - 1.0) > tolerance:
        say("its own step times differ from the shared cost profile's by more than profile.share_tolerance="
            f"{tolerance:g}: " + ", ".join(f"b={b} {mine.seconds[b] * 1e3:.2f} ms against "
                                          f"{found.seconds[b] * 1e3:.2f} ms" for b in sorted(ratios))
            + f" ({done}); labelling with the shared one")
    return found, {"shared": "reused", "key": key, "check_ratio": {str(b): round(r, 4) for b, r in ratios.items()}}


def _wait(done, beat, stale_s: float) -> Optional[CostProfile]:
    """The published profile once there, or None once ``beat`` has not changed for ``stale_s`` (by this
    process's clock: the nodes' clocks need not agree)."""
    last, changed = _text(beat), time.monotonic()
    while True:
        found = _read(done)
        if found is not None:
            return found
        now = _text(beat)
        if now != last:
            last, changed = now, time.monotonic()
        elif time.monotonic() - changed > stale_s:
            return None
        time.sleep(POLL_S)


@contextmanager
def _beating(beat, every_s: float):
    """Rewrites ``beat`` every ``every_s`` while the block runs (a thread: the measuring holds this one)."""
    from pipeline.io.shards import write_text_atomic

    stop = threading.Event()

    def run():
        n = 0
        while True:
            n += 1
            try:
                write_text_atomic(json.dumps({"beat": n}) + "\n", beat)
            except OSError:  # storage not answering: the next beat tries again
                pass
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=run, name="profile-beat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def clear_unfinished_claims(output_dir: str) -> int:
    """Delete every claim (and beat) under ``output_dir/.profiles`` without its profile; how many claims. Safe only
    before this run's workers start (the label driver, under the folder's lease)."""
    from pipeline.io.storage import location

    folder = location(output_dir) / ".profiles"
    if not folder.exists():
        return 0
    cleared = 0
    for path in list(folder.iterdir()):
        key, _, rest = path.name.partition(".")
        if rest.split(".")[0] in ("claim", "beat") and not (folder / f"{key}.json").exists():
            path.unlink()
            cleared += rest.startswith("claim")
    return cleared


def _text(path) -> Optional[str]:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _read(path) -> Optional[CostProfile]:
    try:
        return CostProfile.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
