"""Hub calls retried with backoff (issue #51, point 3): a real HTTP server on 127.0.0.1 stands in for the hub
(HF_ENDPOINT; the hub itself is out of reach here) and answers model_info as the hub does, after some 503s; a
transient refusal is ridden out, a 404 is not retried. Before, one worker's transient hub error refused the run."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub.constants
import pytest

from pipeline.decoding import models

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """model_info for owner/tiny at main: ``busy`` 503s first, then the answer; anything else 404s."""

    def __init__(self, busy: int):
        self.busy, self.seen = busy, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/api/models/"):  # (huggingface_hub also asks for other things once)
                    hub.seen.append(self.path)
                if not self.path.startswith("/api/models/owner/tiny"):
                    return self.answer(404, {"error": "Repository not found"})
                if hub.busy:
                    hub.busy -= 1
                    return self.answer(503, {"error": "Service Unavailable"})
                self.answer(200, {"id": "owner/tiny", "modelId": "owner/tiny", "sha": COMMIT, "siblings": []})

            def answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def hub(monkeypatch, request):
    h = Hub(busy=request.param)
    monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    monkeypatch.setattr(models, "HUB_RETRY_BASE_S", 0.01)
    monkeypatch.setattr(models, "cached_commit", lambda repo, revision: None)  # no local hub cache to fall back on
    models.hub_commit.cache_clear()
    yield h
    models.hub_commit.cache_clear()
    h.server.shutdown()


@pytest.mark.parametrize("hub", [3], indirect=True)
def test_a_busy_hub_is_retried_until_it_answers(hub, caplog):
    caplog.set_level("WARNING", logger="blockpilot.models")
    assert models.hub_commit("owner/tiny", None, "model.draft") == COMMIT
    assert len(hub.seen) == 4  # three 503s, then the answer
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == 3 and retries[0].startswith("model.draft: hub id 'owner/tiny'"), retries


@pytest.mark.parametrize("hub", [10], indirect=True)
def test_a_hub_that_stays_busy_fails_after_the_last_try_naming_the_key(hub):
    with pytest.raises(models.ModelNotFound, match=r"model.draft: hub id 'owner/tiny' could not be resolved"):
        models.hub_commit("owner/tiny", None, "model.draft")
    assert len(hub.seen) == models.HUB_ATTEMPTS


@pytest.mark.parametrize("hub", [0], indirect=True)
def test_a_missing_repo_is_not_retried(hub):
    with pytest.raises(models.ModelNotFound, match="owner/absent"):
        models.hub_commit("owner/absent", None, "model.target")
    assert len(hub.seen) == 1


def test_a_hub_name_that_does_not_resolve_is_not_retried_and_a_moment_of_dns_is(monkeypatch, caplog):
    """A hub host with no DNS answer (a machine without network; `.invalid` never resolves, RFC 2606) fails at
    once: its 4 waits cost every offline process 20 s before the cache's commit. A DNS server failing for a moment
    (EAI_AGAIN) is still retried."""
    import socket

    monkeypatch.setenv("HF_ENDPOINT", "http://hub.blockpilot.invalid")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    # The resolver's answer for `.invalid` as a machine with DNS gives it (EAI_NONAME), whatever this machine's DNS
    # does: one without a reachable server answers EAI_AGAIN, the retried case below, and the test would wait.
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if str(host).endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(models, "cached_commit", lambda repo, revision: None)
    models.hub_commit.cache_clear()
    caplog.set_level("WARNING", logger="blockpilot")
    try:
        with pytest.raises(models.ModelNotFound, match="model.target: hub id 'owner/tiny' could not be resolved"):
            models.hub_commit("owner/tiny", None, "model.target")
    finally:
        models.hub_commit.cache_clear()
    assert not [r for r in caplog.records if "trying again" in r.getMessage()]  # not one wait

    def again():
        try:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        except socket.gaierror as err:
            raise ConnectionError("could not connect") from err

    waits = []
    with pytest.raises(ConnectionError):
        models.with_hub_retries(again, "model.target", attempts=3, sleep=waits.append)
    assert len(waits) == 2  # retried
