"""A real multi-node Ray cluster on this machine for the integration tests: a head (with the dashboard, i.e. the job
server) and worker nodes, each ``ray start --block`` in a session of its own on non-default ports and the cluster's
own temp dir, each advertising the GPUs asked for (logical GPUs: none exists; the models run on the CPU). Nodes can
join after the cluster started (:meth:`Cluster.add_node`). Teardown kills each node's process group (never
``ray stop``, which would kill every Ray on the machine) and reports whatever of the cluster was left.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from .conftest import (PYTHON, RAY, Run, base_env, free_port_range, free_ports, kill_group, marked_pids,
                       reap, short_tmpdir)

# The 2 GB venv, the git store and local runs must not be uploaded with the working dir.
EXCLUDES = [".venv", ".git", "runs", "tmp", "build", "dist", ".whl", "**/__pycache__", ".pytest_cache",
            "*.egg-info", "benchmarks"]


@dataclass
class Node:
    name: str
    run: Run
    ports: set = field(default_factory=set)
    node_id: Optional[str] = None


class Cluster:
    """Head + worker nodes, each ``ray start --block`` in its own session, torn down by process group."""

    def __init__(self, head_gpus: int = 1, head_cpus: int = 2):
        (self.gcs, self.dashboard, nm, om, client, agent, agent_grpc, metrics, rtenv) = free_ports(9)
        self.temp_dir = short_tmpdir("bpc-")
        self.worker_ranges: List[tuple] = []
        # Token auth, as Ray 2.60 defaults to, with this cluster's own token: every node, driver and client of the
        # cluster gets it from the environment (a worker node does not pick up ~/.ray/auth_token by itself).
        self.env = {"RAY_TMPDIR": str(self.temp_dir), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    # On SIGTERM a node drains until idle, for up to 30 s; the detached actors the train job leaves
                    # (Ray Data's stats actor, ...) keep the head from ever going idle. Tear down at once instead.
                    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        self.url = f"http://127.0.0.1:{self.dashboard}"
        workers = self._worker_range()
        self.head_cmd = [
            RAY, "start", "--head", *self._common(head_cpus, head_gpus), f"--port={self.gcs}", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard}", f"--ray-client-server-port={client}",
            f"--node-manager-port={nm}", f"--object-manager-port={om}",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rtenv}",
            f"--min-worker-port={workers[0]}", f"--max-worker-port={workers[1]}"]
        self.ports = {self.gcs, self.dashboard, nm, om, client, agent, agent_grpc, metrics, rtenv}
        self.head: Optional[Node] = None
        self.nodes: List[Node] = []
        self.node_temp_dirs: list = []

    def _common(self, cpus: int, gpus: int, temp_dir=None) -> List[str]:
        return ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
                "--disable-usage-stats", f"--temp-dir={temp_dir or self.temp_dir}"]

    def _worker_range(self) -> tuple:
        r = free_port_range(100, avoid=self.worker_ranges)
        self.worker_ranges.append(r)
        return r

    def start(self, env: Optional[dict] = None) -> "Cluster":
        """Starts the head, ``env`` added to its environment only (a test's sitecustomize hook)."""
        self.head = Node("head", Run(self.head_cmd, {**self.env, **(env or {})}), set(self.ports))
        self.head.run.wait_for(lambda: "Ray runtime started" in self.head.run.output, 120, "the head to start")
        self._wait_for_job_server()
        return self

    def add_node(self, name: str, gpus: int = 1, cpus: int = 1, env: Optional[dict] = None,
                 retry: bool = True) -> Node:
        """A worker node joining the running cluster; returns once the cluster counts it. A ``ray start`` that
        gives up on its own raylet's registration (Ray waits a fixed 30 s, ray/_private/node.py: "timed out during
        startup", seen once in a fresh-clone suite while the other pytest worker compiled) is started once more,
        on new ports; any other failure fails."""
        nm, om, agent, agent_grpc, metrics, rtenv = free_ports(6)
        workers = self._worker_range()
        # Its own temp dir: nodes sharing one would unpack each job's working_dir into the same folder, one node's
        # runtime-env agent re-extracting (or collecting) it under a driver that runs from it on another node.
        temp_dir = short_tmpdir(f"bpn-{name}-")
        self.node_temp_dirs.append(temp_dir)
        cmd = [RAY, "start", f"--address=127.0.0.1:{self.gcs}", *self._common(cpus, gpus, temp_dir),
               f"--node-manager-port={nm}", f"--object-manager-port={om}",
               f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
               f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rtenv}",
               f"--min-worker-port={workers[0]}", f"--max-worker-port={workers[1]}"]
        before = set(self.alive_node_ids())
        node = Node(name, Run(cmd, {**self.env, **(env or {})}), {nm, om, agent, agent_grpc, metrics, rtenv})
        self.nodes.append(node)
        self.ports |= node.ports
        try:
            node.run.wait_for(lambda: "Ray runtime started" in node.run.output, 120, f"node {name} to start")
        except AssertionError:
            if not (retry and "timed out during startup" in node.run.output):
                raise
            print(f"[cluster] {name}: ray start timed out registering its raylet; starting it once more")
            kill_group(node.run.proc, grace=15)
            reap(node.run.marker)
            self.nodes.remove(node)
            return self.add_node(name, gpus, cpus, env, retry=False)
        deadline = time.monotonic() + 120
        while True:
            new = set(self.alive_node_ids()) - before
            if new:
                node.node_id = new.pop()
                return node
            assert time.monotonic() < deadline, f"node {name} never registered"
            time.sleep(0.5)

    def alive_node_ids(self) -> List[str]:
        """The alive nodes, from the head's state API over HTTP (no interpreter and no driver per question)."""
        req = urllib.request.Request(f"{self.url}/api/v0/nodes?limit=1000&detail=false",
                                     headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            nodes = json.loads(r.read())["data"]["result"]["result"]
        return sorted(n["node_id"] for n in nodes if n["state"] == "ALIVE")

    def stop_job(self, submission_id: str) -> None:
        """Stop a submitted job (the job server's REST call, as ``ray job stop`` makes it): killing the ``ray job
        submit`` client leaves the job running on the cluster, holding its GPUs for the module's next test."""
        req = urllib.request.Request(f"{self.url}/api/jobs/{submission_id}/stop", method="POST",
                                     headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200, r.status
        deadline = time.monotonic() + 120
        status = urllib.request.Request(f"{self.url}/api/jobs/{submission_id}",
                                        headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        while time.monotonic() < deadline:
            with urllib.request.urlopen(status, timeout=60) as r:
                if json.loads(r.read())["status"] in ("STOPPED", "SUCCEEDED", "FAILED"):
                    return
            time.sleep(0.5)

    def _wait_for_job_server(self) -> None:
        deadline = time.monotonic() + 90  # the dashboard comes up a little after the raylet
        req = urllib.request.Request(f"{self.url}/api/jobs/",
                                     headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        while True:
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError as err:
                last = err
            assert time.monotonic() < deadline, f"job server never answered: {last}"
            time.sleep(1)

    def head_env(self):
        return base_env(self.head.run.marker, **self.env)

    def submit(self, script: str, *overrides: str, timeout: float = 300, wait: bool = True,
               submission_id: str = "") -> Run:
        """``ray job submit`` a jobs/ entrypoint with the venv python; waits for the job (its logs streamed) unless
        ``wait`` is false (the client then runs on, streaming the logs, until the job ends)."""
        named = ["--submission-id", submission_id] if submission_id else []
        cmd = [RAY, "job", "submit", "--address", self.url, *named, "--working-dir", ".",
               "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--", PYTHON, script, *overrides]
        run = Run(cmd, self.env)
        if wait:
            run.wait(timeout)
        return run

    def shutdown(self) -> dict:
        """Kill the worker nodes' then the head's process group (SIGTERM, SIGKILL after 15 s); return whatever of
        the cluster was still alive 20 s later (then killed by pid)."""
        left = {}
        for node in [*self.nodes[::-1], *([self.head] if self.head else [])]:
            t0 = time.monotonic()
            kill_group(node.run.proc, grace=15)
            print(f"[cluster] {node.name}: ray start exited {node.run.proc.returncode} {time.monotonic() - t0:.1f} s "
                  f"after SIGTERM; left of it: {sorted(marked_pids(node.run.marker).values())}")
        for node in [*self.nodes, *([self.head] if self.head else [])]:
            left.update(reap(node.run.marker))
        self.nodes, self.head = [], None
        for folder in [self.temp_dir, *self.node_temp_dirs]:
            shutil.rmtree(folder, ignore_errors=True)
        return left


def job_ok(run: Run, what: str) -> None:
    assert run.proc.returncode == 0, f"{what} exited {run.proc.returncode}:\n{run.tail(80)}"
    assert "succeeded" in run.output.lower(), run.tail(80)


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
