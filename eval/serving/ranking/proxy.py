"""An OpenAI-compatible proxy that ranks each request and forwards it with vLLM's ``priority``.

Put it in front of a vLLM server started with ``--scheduling-policy priority``; unmodified clients (vLLM's own
``bench serve`` included) then get shortest-predicted-first order.  For ``POST /v1/completions`` and
``/v1/chat/completions`` it reads the prompt (a string, a list of strings, token ids, or the last user
message), scores it with an ``ngram`` ranker (a tokenization and a sparse dot product, no model) and sets
``priority = round(predicted log length * scale)`` (vLLM serves lower values first) unless the client sent a
priority of its own.  Everything else (other paths and methods, headers, status, bodies) passes through;
responses stream through chunk by chunk, so server-sent events arrive as the server sends them.

A request the ranker cannot score (no ranker loaded, a body that is not JSON, a prompt of an unknown shape, an
exception) is forwarded unchanged in priority terms: it gets the constant ``fallback`` priority (the
training mean), so such requests keep their arrival order among themselves — FCFS — and the failure is
logged; no request is dropped by the proxy.  Request bodies are untrusted data: parsed as JSON only, capped
at ``MAX_BODY`` bytes.  Standard library only (``http.server`` threads, ``http.client`` upstream); binds to
loopback unless told otherwise.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
SCORED_PATHS = ("/v1/completions", "/v1/chat/completions")
PRIORITY_LIMIT = 2**31 - 1


def prompt_of(path: str, body: dict):
    """The text (or token ids) the ranker scores: the completion prompt or the last user message."""
    if path.endswith("/chat/completions"):
        users = [m for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError("no user message")
        content = users[-1].get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ValueError("user content is neither text nor parts")
        return content
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
        return prompt
    raise ValueError("prompt is not a string or one list of token ids")


class Prioritizer:
    """Scores request bodies; thread-safe; never raises (a failure gives ``fallback`` and is logged).

    ``oracle=True`` is for benchmarks only: the priority is the request's own ``max_tokens``, which vLLM's
    client sets to the true reply length (with ``--ignore-eos``), i.e. shortest-job-first with true lengths."""

    def __init__(self, ranker_dir=None, scale: float = 1000.0, oracle: bool = False):
        self.scale, self.ranker, self.fallback, self.failures, self.oracle = scale, None, 0, 0, oracle
        self._lock = threading.Lock()
        if oracle:
            log.info("oracle priorities: max_tokens of each request (a benchmark ceiling, not a deployment)")
            return
        if ranker_dir is None:
            log.warning("no ranker: every request gets priority 0 (FCFS order)")
            return
        try:
            from .predictors import Ranker

            ranker = Ranker(ranker_dir)
            if ranker.spec.kind != "ngram":
                raise ValueError(
                    f"{ranker_dir} is a {ranker.spec.kind} ranker; the proxy runs ngram rankers "
                    "(to resolve, train one with --kind ngram)"
                )
            self.ranker = ranker
            self.encode = _encoder(ranker.tokenizer)
            self.fallback = self._priority(-ranker.ngram.bias)
        except Exception as err:  # the proxy still serves, in FCFS order
            log.error(
                "ranker %s not loaded (%s: %s); forwarding in FCFS order", ranker_dir, type(err).__name__, err
            )

    def _priority(self, score: float) -> int:
        return int(np.clip(-round(score * self.scale), -PRIORITY_LIMIT, PRIORITY_LIMIT))

    def priority(self, path: str, body: dict) -> int:
        if self.oracle:
            tokens = body.get("max_tokens", body.get("max_completion_tokens"))
            return int(np.clip(tokens, 0, PRIORITY_LIMIT)) if type(tokens) is int else self.fallback
        if self.ranker is None:
            return self.fallback
        try:
            prompt = prompt_of(path, body)
            ids = self.encode(prompt) if isinstance(prompt, str) else prompt
            return self._priority(float(self.ranker.score_ids([ids])[0]))
        except Exception as err:
            with self._lock:
                self.failures += 1
            log.warning(
                "ranker failed on a request to %s (%s: %s); FCFS priority", path, type(err).__name__, err
            )
            return self.fallback

    def rewrite(self, path: str, raw: bytes) -> bytes:
        """The body to forward: with ``priority`` added where the request is scored, else unchanged."""
        if not path.split("?", 1)[0].endswith(SCORED_PATHS):
            return raw
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            with self._lock:
                self.failures += 1
            log.warning("request body to %s is not JSON (%s); forwarded as is", path, err)
            return raw
        if not isinstance(body, dict) or "priority" in body:
            return raw  # the client's own priority wins
        body["priority"] = self.priority(path, body)
        return json.dumps(body).encode()


def _encoder(tokenizer):
    """``text -> tokenizer(text).input_ids`` that handler threads may call at once, without a lock.

    The transformers wrapper sets the backend's truncation and padding on every call, so concurrent calls
    race and would need a lock (a 1k-token prompt holds it ~1 ms, so a burst of requests queued behind it).
    A private copy of the Rust backend with truncation and padding off encodes the same ids (special tokens
    included) and is safe to share; a tokenizer without a Rust backend keeps the locked wrapper."""
    import copy

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        lock = threading.Lock()

        def locked(text: str) -> list[int]:
            with lock:
                return tokenizer(text).input_ids

        return locked
    backend = copy.deepcopy(backend)
    backend.no_truncation()
    backend.no_padding()
    return lambda text: backend.encode(text).ids


def make_handler(prioritizer: Prioritizer, upstream: str):
    parsed = urllib.parse.urlsplit(upstream)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(
            f"upstream {upstream!r} is not an http:// URL; to resolve, pass e.g. http://127.0.0.1:8000"
        )
    host, port, base = parsed.hostname, parsed.port or 80, parsed.path.rstrip("/")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else a small last write waits ~40 ms for the client's delayed ACK

        def log_message(self, format, *args):  # access log at debug level, not on stderr
            log.debug("%s " + format, self.address_string(), *args)

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._error(413, f"request body of {length} bytes is over {MAX_BODY}; send a smaller one")
                return
            raw = self.rfile.read(length) if length else b""
            if self.command == "POST":
                raw = prioritizer.rewrite(self.path, raw)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            headers["Content-Length"] = str(len(raw))
            conn = http.client.HTTPConnection(host, port, timeout=3600)
            try:
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.request(
                    self.command, base + self.path, body=raw if raw or length else None, headers=headers
                )
                resp = conn.getresponse()
            except OSError as err:
                conn.close()
                self._error(502, f"upstream {upstream} unreachable ({type(err).__name__}: {err})")
                return
            try:
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True  # the client went away mid-stream
            finally:
                conn.close()

        def _error(self, status: int, message: str) -> None:
            log.warning("%s %s: %d %s", self.command, self.path, status, message)
            payload = json.dumps(
                {"error": {"message": message, "type": "proxy_error", "code": status}}
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    return Handler


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # a burst of a few hundred connections must not be refused


def make_server(
    ranker_dir,
    upstream: str,
    host: str = "127.0.0.1",
    port: int = 8100,
    scale: float = 1000.0,
    oracle: bool = False,
):
    """The proxy server (not started): ``serve_forever()`` it, or ``serve`` for the CLI."""
    prioritizer = Prioritizer(ranker_dir, scale, oracle)
    server = ProxyServer((host, port), make_handler(prioritizer, upstream))
    server.prioritizer = prioritizer
    return server


def serve(
    ranker_dir,
    upstream: str,
    host: str = "127.0.0.1",
    port: int = 8100,
    scale: float = 1000.0,
    oracle: bool = False,
) -> None:
    server = make_server(ranker_dir, upstream, host, port, scale, oracle)
    log.info("ranking proxy on http://%s:%d -> %s", host, server.server_address[1], upstream)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class _InstantUpstream(BaseHTTPRequestHandler):
    """vLLM's stand-in for :func:`overhead_ms`: answers every POST at once with a chunked two-event SSE stream,
    one write per event as a streamed completion arrives, Nagle off as vLLM's uvicorn has it."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in (b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.write(b"0\r\n\r\n")


def _percentiles(name: str, values: list[float]) -> dict[str, float]:
    return {f"{name}_p50": float(np.median(values)), f"{name}_p90": float(np.percentile(values, 90))}


def overhead_ms(ranker_dir, prompt_tokens: int = 1000, repeats: int = 300, warmup: int = 20) -> dict:
    """Wall-clock milliseconds the proxy adds to one streamed ``/v1/completions`` request of about
    ``prompt_tokens`` tokens, HTTP relay included, p50 and p90 over ``repeats`` requests.

    The same body goes alternately straight to an instant fake upstream and through a proxy in front of it
    (loopback, keep-alive client connections, one request at a time, ``warmup`` pairs dropped); a pair's
    overhead is proxied minus direct time, so a slow spell of a shared machine hits both.  Client, proxy and
    upstream share this interpreter, which makes it an upper bound for a proxy in its own process.  Beside
    it: the CPU time the proxy adds (process CPU, proxied minus direct; wall minus CPU is time spent waiting
    for a core or the GIL) and the thread CPU time of ``rewrite`` alone (parse, tokenize, score, serialize)."""
    prioritizer = Prioritizer(ranker_dir)
    if prioritizer.ranker is None:
        raise ValueError(f"no ngram ranker loaded from {ranker_dir}; to resolve, train one with --kind ngram")
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _InstantUpstream)
    upstream.daemon_threads = True
    proxy = ProxyServer(
        ("127.0.0.1", 0), make_handler(prioritizer, f"http://127.0.0.1:{upstream.server_address[1]}")
    )
    words = "please explain how the scheduler orders requests by predicted reply length in detail".split()
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(prompt_tokens))
    text = prioritizer.ranker.tokenizer.decode(prioritizer.encode(text)[:prompt_tokens])
    raw = json.dumps({"model": "m", "prompt": text, "max_tokens": 128, "stream": True}).encode()
    servers = [upstream, proxy]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    clients = [http.client.HTTPConnection(*server.server_address[:2], timeout=60) for server in servers]

    def timed(conn: http.client.HTTPConnection) -> tuple[float, float]:
        """Wall-clock and process CPU ms of one request (every thread of this process works on it alone)."""
        start, cpu = time.perf_counter(), time.process_time()
        conn.request("POST", "/v1/completions", body=raw, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read()
        if response.status != 200 or not body.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"the relay answered {response.status} {body[:200]!r}")
        return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3

    try:
        pairs = [(timed(clients[0]), timed(clients[1])) for _ in range(warmup + repeats)][warmup:]
    finally:
        for conn in clients:
            conn.close()
        for server in servers:
            server.shutdown()
            server.server_close()
    cpu = []
    for _ in range(repeats):
        start = time.thread_time()
        prioritizer.rewrite("/v1/completions", raw)
        cpu.append((time.thread_time() - start) * 1e3)
    (direct, direct_cpu), (proxied, proxied_cpu) = (np.array(x).T for x in zip(*pairs, strict=True))
    return {
        "prompt_tokens": len(prioritizer.encode(text)),
        "repeats": repeats,
        **_percentiles("overhead_ms", list(proxied - direct)),
        **_percentiles("overhead_cpu_ms", list(proxied_cpu - direct_cpu)),
        **_percentiles("direct_ms", list(direct)),
        **_percentiles("proxied_ms", list(proxied)),
        **_percentiles("rewrite_cpu_ms", cpu),
        "failures": prioritizer.failures,
        "load_average_1min": os.getloadavg()[0],
    }
