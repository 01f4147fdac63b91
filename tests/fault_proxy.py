"""A fault-injecting HTTP proxy on 127.0.0.1, for tests that put it between the stages and an S3 test server.

    proxy = FaultProxy("http://127.0.0.1:PORT")       # the real server (moto); proxy.endpoint is what clients use
    f = proxy.add("status", method="PUT", path=r"/labels/part-\\d+\\.parquet$", count=2, status=503)
    ...                                                # run the client against proxy.endpoint
    assert f.fired == 2 and proxy.injected["status"] == 2

Every fault is a rule: a kind, which requests it matches (method, and a regex searched in the request target:
path and query, e.g. ``/bucket/run/labels/part-00001.parquet``) and a bounded ``count`` (``None``: every match until
:meth:`FaultProxy.remove`). Rules are tried in the order they were added; the first match with count left fires,
anything else is forwarded unchanged. A rule with ``after=(method, regex)`` is dormant until a request matching that
got a 2xx answer (e.g. "the store goes down once the first shard is in"). Kinds:

* ``status``: answer ``status`` (503 ``SlowDown``, 500 ``InternalError``, ...) with an S3 error document; the request
  never reaches the server.
* ``reset``: read the head and the first ``at`` fraction of the body, then reset the connection (RST); nothing
  reaches the server.
* ``stall``: read the whole request and answer nothing until the client gives up (its read timeout) or ``hold``
  seconds pass, then close; nothing reaches the server. ``timed_out`` counts the stalls the client abandoned first.
* ``lost_response``: forward the request (the server acts on it), then reset the connection instead of answering:
  the client cannot tell a done PUT from a failed one and must retry an idempotent request.
* ``cut``: forward the head and the first ``at`` fraction of the body to the server, set ``applied``, then wait (at most
  ``hold`` s) for the client to go away (a killed writer) or for ``release``, and reset both connections: an upload
  killed halfway, as the server sees it.

Besides the rules, :meth:`FaultProxy.refuse` closes the listening port (connection refused, as for a store that is
down) and :meth:`FaultProxy.accept` opens it again on the same port; :meth:`FaultProxy.refuse_after` arms the same
for the moment a matching request got its 2xx (the port is shut before that answer is sent, so that no later request
of the client gets through, however fast it is: a test polling for the 2xx and then refusing raced it). The proxy
counts what it injected (``injected``, per kind, and ``Fault.fired``) and logs every request with its outcome
(``log``), so that a test can assert that its faults really happened, and that the client retried after each.

Why not a maintained tool: toxiproxy (Shopify) is the usual one, but it is a Go server to install beside the tests
(PyPI has only its client, toxiproxy-python), and it works at the TCP level: its toxics (latency, timeout,
reset_peer, slicer, ...) apply to every connection of a proxied port, and it does not parse HTTP, so it can neither
answer a 503 nor pick "the next two PUTs of part-00001.parquet", which is what these tests need. mitmproxy parses
HTTP and is scriptable, but it is a large dependency with its own event loop, run as a separate process, for one test
module. This is the standard library only (socket, threading, http.client), in the test process, under the test's
control.
"""

from __future__ import annotations

import http.client
import re
import select
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit

KINDS = ("status", "reset", "stall", "lost_response", "cut")
REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
MESSAGES = {"SlowDown": "Please reduce your request rate.",
            "InternalError": "We encountered an internal error. Please try again.",
            "ServiceUnavailable": "Service is unable to handle request."}


@dataclass
class Fault:
    kind: str
    method: Optional[str] = None  # None: any method
    path: Optional[str] = None  # a regex searched in the request target (path?query); None: any
    count: Optional[int] = 1  # how many matching requests it fires on; None: all, until removed
    status: int = 503  # kind status
    code: str = "SlowDown"  # kind status: the S3 error code in the body
    at: float = 0.5  # reset, cut: the fraction of the request body read (cut: and forwarded) before the cut
    hold: float = 120.0  # stall, cut: the longest the proxy waits before it closes
    after: Optional[Tuple[Optional[str], str]] = None  # (method, regex): dormant until such a request got a 2xx
    fired: int = 0
    timed_out: int = 0  # stall: the client closed before `hold` ran out (its read timeout fired)
    hit: threading.Event = field(default_factory=threading.Event)  # set when it first fires
    applied: threading.Event = field(default_factory=threading.Event)  # set once it has acted (cut: half sent)
    release: threading.Event = field(default_factory=threading.Event)  # cut: reset now
    targets: List[str] = field(default_factory=list)  # "METHOD target" of each request it fired on

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {KINDS}")
        self._re = re.compile(self.path) if self.path else None
        self.armed = self.after is None

    def matches(self, method: str, target: str) -> bool:
        return (self.armed and (self.method is None or self.method == method)
                and (self._re is None or bool(self._re.search(target)))
                and (self.count is None or self.fired < self.count))

    def arm_on(self, method: str, target: str, status: int) -> None:
        if not self.armed and _answered(self.after, method, target, status):
            self.armed = True

    def __repr__(self) -> str:
        what = {"status": f"status {self.status} {self.code}", "reset": f"reset at {self.at:.0%} of the body",
                "cut": f"cut at {self.at:.0%} of the body"}.get(self.kind, self.kind)
        return (f"Fault({what}, {self.method or 'any'} {self.path or '.*'}, fired {self.fired}/"
                f"{'unbounded' if self.count is None else self.count}"
                + (f", client timed out {self.timed_out}" if self.kind == "stall" else "") + ")")


class _Request:
    def __init__(self, method: str, target: str, head_lines: List[bytes], headers: Dict[str, str]):
        self.method, self.target, self.head_lines, self.headers = method, target, head_lines, headers

    def upstream_head(self) -> bytes:
        """The client's request head as it came (every signed header intact), but ``Connection: close`` (one
        upstream connection per request) and no ``Expect`` (the proxy answered the 100-continue itself)."""
        out = [self.head_lines[0]]
        for line in self.head_lines[1:]:
            name = line.split(b":", 1)[0].strip().lower()
            if name not in (b"connection", b"expect", b"keep-alive", b"proxy-connection"):
                out.append(line)
        out.append(b"Connection: close\r\n")
        return b"".join(out) + b"\r\n"


class FaultProxy:
    """See the module docstring. A context manager; :meth:`close` stops it."""

    def __init__(self, upstream: str, port: int = 0, latency_s: float = 0.0):
        u = urlsplit(upstream)
        # Added to every request before it is answered, each connection on its own thread: a store's round trip
        # (benchmarks/scale.py's --latency-ms), so that requests made one after another cost what they cost at a
        # real store while requests made in parallel overlap.
        self.latency_s = latency_s
        self.upstream: Tuple[str, int] = (u.hostname, u.port or 80)
        self.rules: List[Fault] = []
        self.injected: Counter = Counter()
        self.log: List[Tuple[str, str, str]] = []  # (method, target, outcome): "200", "status 503", "reset", ...
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._conns: set = set()
        self._listener: Optional[socket.socket] = None
        self._port = port
        self._down = threading.Event()  # set: every request is reset, even on a connection already open
        self._refuse_after: Optional[Tuple[Optional[str], str]] = None
        self.accept()

    # ---- control -------------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def add(self, kind: str, method: Optional[str] = None, path: Optional[str] = None, count: Optional[int] = 1,
            **options) -> Fault:
        fault = Fault(kind, method, path, count, **options)
        with self._lock:
            self.rules.append(fault)
        return fault

    def remove(self, fault: Fault) -> None:
        with self._lock:
            self.rules = [r for r in self.rules if r is not fault]
        fault.release.set()

    def clear(self) -> None:
        with self._lock:
            rules, self.rules = self.rules, []
        for r in rules:
            r.release.set()

    def outcomes(self, method: Optional[str] = None, path: Optional[str] = None) -> List[str]:
        """The outcome of every logged request that matches, in order."""
        pat = re.compile(path) if path else None
        with self._lock:
            return [o for m, t, o in self.log
                    if (method is None or m == method) and (pat is None or pat.search(t))]

    def refuse(self) -> None:
        """Close the port (new connections are refused) and every open connection: the store is down."""
        self._close_listener()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close_listener(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        # shutdown() first: close() alone does not wake a thread blocked in accept() or recv() on the socket (the
        # kernel keeps the socket while a call is in it), and the port would go on accepting.
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()

    def refuse_after(self, method: Optional[str], path: str) -> None:
        """:meth:`refuse` once a request matching ``method`` (None: any) and ``path`` (a regex searched in the
        target) got a 2xx: the proxy goes down before it sends that answer, and sends it, so that the client hears
        the request succeed and finds the store down for the next one."""
        self._refuse_after = (method, path)

    def accept(self) -> None:
        """Listen (again) on the proxy's port."""
        self._refuse_after = None
        self._down.clear()
        if self._listener is not None:
            return
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self._port))
        s.listen(64)
        self._port = s.getsockname()[1]
        self._listener = s
        threading.Thread(target=self._accept_loop, args=(s,), name="fault-proxy-accept", daemon=True).start()

    def close(self) -> None:
        self._closing.set()
        self.clear()
        self.refuse()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- serving -------------------------------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed by refuse() / close()
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fault-proxy-conn", daemon=True).start()

    def _record(self, req: _Request, outcome: str, fault: Optional[Fault] = None) -> None:
        with self._lock:
            self.log.append((req.method, req.target, outcome))
            if fault is not None:
                self.injected[fault.kind] += 1

    def _match(self, req: _Request) -> Optional[Fault]:
        with self._lock:
            for rule in self.rules:
                if rule.matches(req.method, req.target):
                    rule.fired += 1
                    rule.targets.append(f"{req.method} {req.target}")
                    rule.hit.set()
                    return rule
        return None

    def _serve(self, conn: socket.socket) -> None:
        rfile = conn.makefile("rb")
        abort = True  # every way out but a clean end of the client's requests resets the connection
        try:
            while not self._closing.is_set():
                req = _read_head(rfile)
                if req is None:
                    abort = False
                    return
                if self.latency_s:
                    time.sleep(self.latency_s)
                if self._down.is_set():  # down (refuse_after) while this connection was open: as refused
                    self._record(req, "reset (down)")
                    return
                fault = self._match(req)
                if req.headers.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                length = int(req.headers.get("content-length", 0) or 0)
                chunked = "chunked" in req.headers.get("transfer-encoding", "").lower()
                if fault is not None and fault.kind in ("reset", "cut"):
                    part = rfile.read(int(length * fault.at)) if not chunked else rfile.readline()
                    if fault.kind == "reset":
                        self._record(req, "reset", fault)
                        _reset(conn)
                        fault.applied.set()
                        return
                    self._cut(conn, req, part, fault)
                    return
                body = _read_chunked(rfile) if chunked else rfile.read(length)
                if fault is not None and fault.kind == "status":
                    self._record(req, f"status {fault.status}", fault)
                    _send_error(conn, fault.status, fault.code, req.target, head_only=req.method == "HEAD")
                    fault.applied.set()
                elif fault is not None and fault.kind == "stall":
                    fault.applied.set()
                    gave_up = _wait_for_close(conn, fault.hold, (self._closing, fault.release))
                    with self._lock:
                        fault.timed_out += gave_up
                    self._record(req, "stall (client gave up)" if gave_up else "stall", fault)
                    return
                else:
                    status, head, data = self._forward(req, body)
                    if fault is not None:  # lost_response: the server acted, the client hears nothing
                        self._record(req, f"lost_response (server said {status})", fault)
                        _reset(conn)
                        fault.applied.set()
                        return
                    self._record(req, str(status))
                    with self._lock:
                        for rule in self.rules:
                            rule.arm_on(req.method, req.target, status)
                    down = self._refuse_after is not None and _answered(self._refuse_after, req.method, req.target,
                                                                         status)
                    if down:  # before the answer: nothing the client sends after hearing it gets through
                        self._down.set()
                        self._close_listener()
                    conn.sendall(head + data)
                    if down:
                        self.refuse()
                        abort = False
                        return
                if req.headers.get("connection", "").lower() == "close":
                    abort = False
                    return
        except OSError:  # the client went away: nothing to answer
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                rfile.close()
            except OSError:
                pass
            if abort:
                _reset(conn)
            else:
                try:
                    conn.close()
                except OSError:
                    pass

    def _forward(self, req: _Request, body: bytes) -> Tuple[int, bytes, bytes]:
        up = socket.create_connection(self.upstream, timeout=120)
        try:
            up.sendall(req.upstream_head() + body)
            resp = http.client.HTTPResponse(up, method=req.method)
            resp.begin()
            data = resp.read()
            lines = [f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode("latin-1")]
            for name, value in resp.getheaders():
                low = name.lower()
                if low in ("transfer-encoding", "connection", "keep-alive"):
                    continue
                if low == "content-length" and req.method != "HEAD":
                    continue  # set below from the body as read (HEAD keeps the object's length, with no body)
                lines.append(f"{name}: {value}\r\n".encode("latin-1"))
            if req.method != "HEAD" and resp.status not in (204, 304):
                lines.append(f"Content-Length: {len(data)}\r\n".encode())
            lines.append(b"Connection: keep-alive\r\n\r\n")
            return resp.status, b"".join(lines), data
        finally:
            up.close()

    def _cut(self, conn: socket.socket, req: _Request, part: bytes, fault: Fault) -> None:
        """Forward the head and ``part`` of the body, then wait for the client to go (or ``release``) and reset
        both ends: the server sees an upload that stopped halfway and then a dead connection."""
        up = socket.create_connection(self.upstream, timeout=120)
        try:
            up.sendall(req.upstream_head() + part)
            fault.applied.set()
            gave_up = _wait_for_close(conn, fault.hold, (self._closing, fault.release))
            self._record(req, f"cut after {len(part)} body bytes" + (" (client gone)" if gave_up else ""), fault)
        finally:
            _reset(up)
            _reset(conn)


# ---- helpers ---------------------------------------------------------------------------------------------------------

def _answered(when: Tuple[Optional[str], str], method: str, target: str, status: int) -> bool:
    """Whether a request got the 2xx that ``when`` = (method, None: any; regex searched in the target) waits for."""
    return 200 <= status < 300 and when[0] in (None, method) and bool(re.search(when[1], target))


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST (ECONNRESET), not a clean FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _read_head(rfile) -> Optional[_Request]:
    line = rfile.readline(65537)
    while line in (b"\r\n", b"\n"):  # stray CRLF between requests
        line = rfile.readline(65537)
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) < 2:
        return None
    lines, headers = [line], {}
    while True:
        h = rfile.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        lines.append(h)
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return _Request(parts[0].upper(), parts[1], lines, headers)


def _read_chunked(rfile) -> bytes:
    """A chunked body, raw (size lines and all), to forward as it came."""
    out = []
    while True:
        size_line = rfile.readline()
        out.append(size_line)
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers, then the blank line
                t = rfile.readline()
                out.append(t)
                if t in (b"\r\n", b"\n", b""):
                    return b"".join(out)
        out.append(rfile.read(size + 2))


def _send_error(conn: socket.socket, status: int, code: str, target: str, head_only: bool = False) -> None:
    """An S3 error answer; to a HEAD, the status alone (a body there would be read as the next answer)."""
    body = b"" if head_only else (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{MESSAGES.get(code, code)}</Message><Resource>{target}</Resource>"
            f"<RequestId>fault-proxy</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n").encode()
    conn.sendall(head + body)


def _wait_for_close(conn: socket.socket, hold: float, stop: Tuple[threading.Event, ...]) -> bool:
    """Wait until the client closes or resets ``conn`` (True), or ``hold`` s pass or a ``stop`` event is set (False).

    Polled for POLLRDHUP (Linux), which reports the peer's FIN even while unread bytes are queued: a cut upload
    leaves the rest of its body unread here, so that the writer stays blocked mid-upload until it dies."""
    poller = select.poll()
    poller.register(conn, getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR)
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not any(e.is_set() for e in stop):
        if poller.poll(50):
            return True
    return False
