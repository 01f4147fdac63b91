"""The preflight's checks: what every worker checks on its node before a stage's first shard, and the verdict over all
of them. Ray-free: ``pipeline/executor/ray/preflight.py`` runs :func:`check_worker` in one actor per expected worker, then
:func:`unreadable` on each for every other worker's probe, and :func:`verdict` in the driver.

A worker checks, without loading a weight:

* ``model.device``: the device Ray gives it against what torch sees (Ray's GPU ids but no CUDA for torch is a CPU
  build of torch, or a driver missing), the dtype ``model.dtype`` resolves to there, and the device's memory;
* ``model.target`` / ``model.draft``: reachable, config and weight index consistent with the class that will load
  them (pipeline.decoding.provenance.check_checkpoint), and the same bytes as the driver recorded (provenance);
* ``versions``: torch, transformers and dflash as in the driver (they change the numerics);
* ``output_dir``: a probe written and read back here, then read by every other worker and by the driver, and the
  driver's probe read here: storage every node and the driver share;
* the memory plan (the stage's ``memory_check``: pipeline.decoding.memory) against the device's memory.

Each failure is ``(config key, message)``: the refusal names the node and the key.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

Problem = Tuple[str, str]  # (config key, what is wrong)
GB = 1024 ** 3


@dataclass
class PreflightSpec:
    """What the driver asks every worker to check (pickled to the actors)."""

    stage: str
    device: str  # "cuda" | "cpu": where the placement runs the models
    dtype: str  # model.dtype as configured ("auto" resolves per device)
    models: Dict[str, Tuple[str, Optional[str]]] = field(default_factory=dict)  # "model.draft" -> (where, revision)
    expect: Dict[str, Any] = field(default_factory=dict)  # the driver's provenance per key, and "versions"
    output_dir: Optional[str] = None
    token: str = ""  # this preflight's id: its probe files' folder


def device_facts(device: str) -> Dict[str, Any]:
    """What torch sees on this worker: the device it will run on, its name and memory (total, free)."""
    import torch

    cuda = torch.cuda.is_available()
    facts: Dict[str, Any] = {"torch": torch.__version__, "cuda_available": cuda,
                             "cuda_devices": torch.cuda.device_count() if cuda else 0}
    if device == "cuda" and cuda:
        free, total = torch.cuda.mem_get_info(0)
        facts.update(device_name=torch.cuda.get_device_name(0), memory_total=total, memory_free=free,
                     bf16=torch.cuda.is_bf16_supported())
    else:
        total, free = host_memory()
        facts.update(device_name="cpu", memory_total=total, memory_free=free, bf16=True)
    return facts


def host_memory() -> Tuple[Optional[int], Optional[int]]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; (None, None) where there is none."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        return (int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None, None


def check_worker(spec, stage, threads: Optional[int] = None) -> Dict[str, Any]:
    """One worker's row: the facts of its node and the problems found there."""
    from pipeline.decoding.models import resolve_dtype

    import torch

    row: Dict[str, Any] = {"host": socket.gethostname(), "problems": []}
    if spec is None:  # a stage without models (the pool's own tests): presence is all there is to check
        return row
    problems: List[Problem] = row["problems"]
    facts = device_facts(spec.device)
    row.update(facts)
    if spec.device == "cuda" and not facts["cuda_available"]:
        problems.append(("model.device", f"Ray gave this worker a GPU but torch {facts['torch']} sees no CUDA device "
                                         "(a CPU build of torch, or no driver); model.device=cpu runs on the CPU"))
    dtype = resolve_dtype(spec.dtype, torch.device(spec.device))
    row["dtype"] = str(dtype).replace("torch.", "")
    if dtype == torch.bfloat16 and not facts.get("bf16", True):
        problems.append(("model.dtype", f"{facts.get('device_name')} has no bfloat16; set model.dtype=float16"))
    problems += _models(spec, row)
    problems += _output_dir(spec, row)
    memory = stage.memory_check(facts, dtype)
    if memory:
        row["memory"] = memory
        if memory.get("need") and memory.get("have") and memory["need"] > memory["have"]:
            problems.append((memory["key"], memory["detail"]))
    return row


def _models(spec, row: Dict[str, Any]) -> List[Problem]:
    from pipeline.decoding.models import ModelNotFound
    from pipeline.decoding.provenance import check_checkpoint, model_provenance, software_versions

    problems: List[Problem] = []
    versions = software_versions()
    row["versions"] = versions
    want = spec.expect.get("versions")
    if want and want != versions:
        diff = ", ".join(f"{k} {versions.get(k)} (driver {want.get(k)})" for k in want if want.get(k) != versions.get(k))
        problems.append(("versions", f"not the driver's: {diff}"))
    row["models"] = {}
    for key, (where, revision) in spec.models.items():
        kind = key.split(".")[-1]
        try:
            found = check_checkpoint(where, revision, key, kind=kind)
            prov = model_provenance(where, revision, key)
        except ModelNotFound as err:
            text = str(err)
            problems.append((key, text[len(key) + 2:] if text.startswith(key + ": ") else text))
            row["models"][key] = "missing"
            continue
        except Exception as err:  # noqa: BLE001 - unreadable in any other way: said, with the key
            problems.append((key, f"{where}: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}"))
            row["models"][key] = "unreadable"
            continue
        problems += [(key, p[len(key) + 2:] if p.startswith(key + ": ") else p) for p in found]
        expected = (spec.expect.get(key) or {}).get("revision")
        if expected and prov.get("revision") != expected:
            problems.append((key, f"{where} here is {prov.get('revision')}, the driver recorded {expected}: the nodes "
                                  "do not hold the same model"))
        row["models"][key] = "mismatch" if found else "ok"
        row.setdefault("provenance", {})[key] = prov
    return problems


def probe_path(spec, identity: str):
    from pipeline.io.storage import location

    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in identity)
    return location(spec.output_dir) / ".preflight" / spec.token / f"{safe}.txt"


def _output_dir(spec, row: Dict[str, Any]) -> List[Problem]:
    """A probe file under output_dir written and read back here (every other worker reads it next)."""
    if not spec.output_dir:
        return []
    import os

    probe = probe_path(spec, f"{row['host']}-{os.getpid()}")
    text = f"{row['host']} {os.getpid()}\n"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(text)
        if probe.read_text() != text:
            raise OSError("read back something else")
    except Exception as err:  # noqa: BLE001 - any storage error, said with the key
        row["output_dir"] = "no"
        return [("output_dir", f"{spec.output_dir} is not writable here: {type(err).__name__}: "
                               f"{(str(err).splitlines() or [''])[0]}")]
    row["output_dir"] = "rw"
    row["probe"] = str(probe)
    return []


def driver_probe(spec) -> Optional[str]:
    """The driver's own probe under output_dir, which every worker must read (the driver writes the manifest and
    ``_SUCCESS`` over what they wrote, and the next stage's driver plans from it); None when the driver cannot
    write there, which the driver's own writable check reports first."""
    import os
    import socket

    if not spec.output_dir:
        return None
    probe = probe_path(spec, f"driver-{socket.gethostname()}-{os.getpid()}")
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(f"driver {socket.gethostname()} {os.getpid()}\n")
    except Exception:  # noqa: BLE001 - the stage's writable check says it, naming the folder
        return None
    return str(probe)


def unreadable(probes: List[str]) -> List[str]:
    """The probes (written by other workers, or the driver) this process cannot read."""
    from pipeline.io.storage import location

    bad = []
    for p in probes:
        try:
            location(p).read_text()
        except Exception:  # noqa: BLE001 - any storage error is the finding
            bad.append(p)
    return bad


def verdict(spec, rows: List[Dict[str, Any]]) -> List[Tuple[str, str, str]]:
    """Every problem as (where, config key, message); one found on several workers is said once, naming them."""
    found: Dict[Tuple[str, str], List[str]] = {}
    kinds = {r.get("dtype") for r in rows if r.get("dtype")}
    if len(kinds) > 1:  # one run, one numerics: never fp32 shards beside bf16 ones
        found[("model.dtype", f"the workers resolve to different dtypes: {sorted(kinds)}")] = ["the cluster"]
    for r in rows:
        for k, m in r.get("problems", []):
            found.setdefault((k, m), []).append(where(r))
    return [(ws[0] if len(ws) == 1 else f"{len(ws)} workers ({', '.join(ws)})", k, m) for (k, m), ws in found.items()]


def where(row: Dict[str, Any]) -> str:
    return f"{row.get('identity', '?')} on {row.get('node_ip') or row.get('host', '?')}"


def _uniform(row: Dict[str, Any]) -> Tuple:
    """What a healthy worker's table row says apart from its name, node, GPU ids and free memory."""
    models = set((row.get("models") or {}).values())
    mem = row.get("memory") or {}
    return (str(row.get("device_name") or "-"), row.get("dtype", "-"), "-" if not models else
            "ok" if models == {"ok"} else "FAIL", row.get("output_dir", "-"), mem.get("need"), mem.get("batch"))


def one_line(rows: List[Dict[str, Any]]) -> Optional[str]:
    """The table in one line where it would repeat one row: every worker answered, none has a problem, and all
    have the same device kind, dtype, models, output and memory plan (the least free memory shown); None
    otherwise (a cluster of 64 identical GPUs is one line, a worker that differs brings the table back)."""
    if not rows or any(r.get("problems") or "pid" not in r for r in rows) or len({_uniform(r) for r in rows}) > 1:
        return None
    device, dtype, models, output, need, batch = _uniform(rows[0])
    haves = [h for h in ((r.get("memory") or {}).get("have") or r.get("memory_free") for r in rows) if h]
    memory = (f"{need / GB:.1f}/{min(haves) / GB:.1f} GiB" if need and haves else
              f"-/{min(haves) / GB:.1f} GiB" if haves else "-") + (f" (batch {batch})" if batch else "")
    nodes = len({r.get("node_ip") or r.get("host") for r in rows})
    return (f"every worker {device}, {dtype}, models {models}, output {output}, memory plan/budget {memory}, "
            f"on {nodes} node(s)")


def table(rows: List[Dict[str, Any]]) -> List[str]:
    """One short line per worker."""
    head = f"{'worker':<24} {'node':<15} {'device':<22} {'dtype':<9} {'models':<9} {'output':<6} memory plan/budget"
    lines = [head]
    for r in rows:
        models = set((r.get("models") or {}).values())
        ok = "-" if not models else "ok" if models == {"ok"} else "FAIL"
        mem = r.get("memory") or {}
        have = mem.get("have") or r.get("memory_free")
        memory = (f"{mem['need'] / GB:.1f}/{have / GB:.1f} GiB" if mem.get("need") and have
                  else f"-/{have / GB:.1f} GiB" if have else "-") + (f" (batch {mem['batch']})" if "batch" in mem else "")
        device = str(r.get("device_name") or "-")[:14] + (f" gpu{','.join(r.get('gpu_ids', []))}"
                                                          if r.get("gpu_ids") else "")
        bad = " !" if r.get("problems") else ""
        lines.append(f"{str(r.get('identity', '?'))[:24]:<24} {str(r.get('node_ip') or r.get('host'))[:15]:<15} "
                     f"{device:<22} {str(r.get('dtype', '-')):<9} {ok:<9} {str(r.get('output_dir', '-')):<6} "
                     f"{memory}{bad}")
    return lines
