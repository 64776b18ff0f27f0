"""An OpenAI-compatible proxy that ranks each request and forwards it with vLLM's ``priority``.

Put it in front of a vLLM server started with ``--scheduling-policy priority``; unmodified clients (vLLM's own
``bench serve`` included) then get shortest-predicted-first order.  For ``POST /v1/completions`` and
``/v1/chat/completions`` it reads the prompt (a string, a list of strings, token ids, or the last user
message), scores it with an ``ngram`` ranker (a tokenization and a sparse dot product, no model) and sets
``priority = round((predicted log length + arrival / aging_s) * scale)`` (vLLM serves lower values first;
arrival in seconds since the proxy started), replacing any priority the client sent (any value would jump all
ranked traffic) unless ``honour_client_priority``.

The arrival term is aging: vLLM fixes a request's priority when it arrives and its waiting queue never
re-prioritizes (a heap on ``(priority, arrival_time)``, ``vllm/v1/core/sched/request_queue.py``), so a long
prediction could wait behind every later short one forever.  Linear aging — the key falls by one unit of log
length per ``aging_s`` seconds waited — never changes the order of two requests once both have arrived (their
waiting times differ by a constant), so it is exactly this static priority, and vLLM's heap applies it: a request
that arrived ``aging_s`` seconds earlier outranks one predicted e times shorter, and one that has waited
``aging_s * (its predicted log length - the shortest's)`` outranks every later arrival.  The victim of a KV
eviction (vLLM evicts the running request of the largest priority value) is then a late arrival too.
``aging_s=None`` switches it off.  Everything else
(other paths and methods, headers, status, bodies) passes through; responses stream through chunk by chunk, so
server-sent events arrive as the server sends them.

A request the ranker cannot score (no ranker loaded, a body that is not JSON, a prompt of an unknown shape, an
exception) is forwarded unchanged in priority terms: it gets the ``fallback`` log length (the training mean),
aged like any other, so such requests keep their arrival order among themselves — FCFS — and the failure is
logged; no request is dropped by the proxy.

Clients are untrusted: bodies are parsed as JSON only and capped at ``MAX_BODY`` bytes; a request must arrive
(head and body) within ``client_timeout`` seconds of the connection turning to it; at most ``max_connections``
connections are served at once (the next get a 503); a malformed request (a bad length, a broken chunked body,
a path or header the upstream request cannot carry) gets a 4xx and the connection is closed, so its unread
bytes are never taken for a next request; a client that hangs up closes its upstream request, which vLLM
aborts.  ``make_server`` first checks that the upstream accepts a priority.  Standard library only
(``http.server`` threads, ``http.client`` upstream, one epoll thread for hang-ups: Linux); binds to loopback
unless told otherwise.
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import os
import re
import select
import socket
import sys
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from toolkit.cliargs import UsageError

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20
# a burst of a few hundred requests fits (vLLM's bench serve opens a connection for each)
MAX_CONNECTIONS = 1024
CLIENT_TIMEOUT = 10.0  # seconds a client may take to send a request, or idle on a keep-alive connection
UPSTREAM_TIMEOUT = 3600.0  # seconds the upstream may go silent: a queued request can wait long for its turn
PROBE_TIMEOUT = 300.0  # the start-up probe's one token, on a CPU server's first request
LINGER = 1.0  # seconds an error response waits for the client's unread bytes before closing (see _linger)
MAX_LINE = 4096  # bytes in a chunk-size or trailer line
MAX_TRAILERS = 64
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
    "expect",  # the proxy answered the client's 100-continue; the upstream gets the whole body at once
}
SCORED_PATHS = ("/v1/completions", "/v1/chat/completions")
PRIORITY_LIMIT = 2**31 - 1
PROBE_PRIORITY = 1  # vLLM's FCFS scheduler accepts 0 and refuses any other value
AGING_S = 60.0  # seconds of waiting worth one unit of predicted log length (scripts/bench_rank_aging.py)
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() takes "¹", which int() refuses
_HEX = re.compile(rb"[0-9a-fA-F]+")


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
    client sets to the true reply length (with ``--ignore-eos``), i.e. shortest-job-first with true lengths.
    ``honour_client_priority=True`` keeps a priority the client sent, for trusted clients only: any client could
    otherwise put itself ahead of all ranked traffic.  ``aging_s`` adds the arrival time (``clock()`` seconds
    since the prioritizer was made) over ``aging_s`` to the predicted log length (the module's docstring);
    unscored requests age alike, oracle priorities do not."""

    def __init__(
        self,
        ranker_dir=None,
        scale: float = 1000.0,
        oracle: bool = False,
        honour_client_priority: bool = False,
        aging_s: float | None = AGING_S,
        clock=time.monotonic,
    ):
        if aging_s is not None and not 0 < aging_s < float("inf"):
            raise ValueError(
                f"aging_s={aging_s} is not a positive number of seconds; to resolve, pass e.g. 60"
            )
        self.scale, self.ranker, self.fallback, self.failures, self.oracle = scale, None, 0.0, 0, oracle
        self.honour_client_priority, self.aging_s, self.clock = honour_client_priority, aging_s, clock
        self.epoch = clock()
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
            self.fallback = ranker.ngram.bias
        except Exception as err:  # the proxy still serves, in FCFS order
            log.error(
                "ranker %s not loaded (%s: %s); forwarding in FCFS order", ranker_dir, type(err).__name__, err
            )

    def aged(self, log_len: float) -> int:
        """vLLM's priority of a request predicted ``log_len`` arriving now: ``(log_len + arrival / aging_s) *
        scale``, rounded, within vLLM's int range (the clip binds after 2**31 / scale * aging_s seconds: over
        four years at the defaults)."""
        key = log_len if self.aging_s is None else log_len + (self.clock() - self.epoch) / self.aging_s
        return int(np.clip(round(key * self.scale), -PRIORITY_LIMIT, PRIORITY_LIMIT))

    def priority(self, path: str, body: dict) -> int:
        if self.oracle:
            tokens = body.get("max_tokens", body.get("max_completion_tokens"))
            return int(np.clip(tokens, 0, PRIORITY_LIMIT)) if type(tokens) is int else 0
        if self.ranker is None:
            return self.aged(self.fallback)
        try:
            prompt = prompt_of(path, body)
            ids = self.encode(prompt) if isinstance(prompt, str) else prompt
            return self.aged(-float(self.ranker.score_ids([ids])[0]))
        except Exception as err:
            with self._lock:
                self.failures += 1
            log.warning(
                "ranker failed on a request to %s (%s: %s); FCFS priority", path, type(err).__name__, err
            )
            return self.aged(self.fallback)

    def rewrite(self, path: str, raw: bytes) -> bytes:
        """The body to forward: with ``priority`` added where the request is scored, else unchanged."""
        if not path.split("?", 1)[0].endswith(SCORED_PATHS):
            return raw
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as err:  # RecursionError: nested deeper than the stack allows
            with self._lock:
                self.failures += 1
            log.warning("request body to %s is not JSON (%s); forwarded as is", path, err)
            return raw
        if not isinstance(body, dict) or (self.honour_client_priority and "priority" in body):
            return raw
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


def _split_upstream(upstream: str) -> tuple[str, int, str]:
    """Host, port and base path of an ``http://`` upstream URL."""
    parsed = urllib.parse.urlsplit(upstream)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(
            f"upstream {upstream!r} is not an http:// URL; to resolve, pass e.g. http://127.0.0.1:8000"
        )
    return parsed.hostname, parsed.port or 80, parsed.path.rstrip("/")


class BadRequest(Exception):
    """A request the proxy refuses with ``status``; the connection closes after the answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _ClientReader(io.RawIOBase):
    """The client socket read against a deadline for the whole request, not per read: a client that sends a
    byte every second (slow loris) never trips a per-read timeout but would hold a thread forever."""

    def __init__(self, sock: socket.socket):
        self.sock, self.deadline = sock, None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive in time")
            self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _HangupWatch:
    """Shuts a request's upstream connection when its client hangs up, which makes vLLM abort the request.

    Without it a non-streamed request, or a streamed one still queued, has no write to fail and the server
    generates the whole reply for nobody.  One thread and one epoll set (``EPOLLRDHUP``: the peer closed) for the
    whole server; a request is watched while it is upstream (a register and an unregister, a few µs)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._lock = threading.Lock()
        self._upstreams: dict[int, socket.socket] = {}
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        threading.Thread(target=self._run, name="proxy-hangups", daemon=True).start()

    def watch(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self._upstreams[client.fileno()] = upstream
            self._epoll.register(client.fileno(), select.EPOLLRDHUP)

    def unwatch(self, client: socket.socket) -> bool:
        """Stops watching ``client``; True if it hung up (and its upstream connection was shut)."""
        with self._lock:
            if self._upstreams.pop(client.fileno(), None) is None:
                return True
            self._epoll.unregister(client.fileno())
            return False

    def close(self) -> None:
        with self._lock:
            if not self._closed:  # the thread closes the pipe once woken: never write to a reused fd
                self._closed = True
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        probe = select.poll()
        try:
            while True:
                for fd, _ in self._epoll.poll():
                    if fd == self._wake_r:
                        return
                    with self._lock:
                        upstream = self._upstreams.get(fd)
                        if upstream is None:
                            continue
                        # the event may predate an unwatch, a close and a new connection on the same fd: ask again
                        probe.register(fd, select.POLLRDHUP)
                        hung_up = bool(probe.poll(0))
                        probe.unregister(fd)
                        if not hung_up:
                            continue
                        del self._upstreams[fd]
                        self._epoll.unregister(fd)
                    try:
                        upstream.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the upstream closed it first
        finally:
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)


def make_handler(prioritizer: Prioritizer, upstream: str, client_timeout: float = CLIENT_TIMEOUT):
    """The request handler class of a proxy in front of ``upstream`` (bound here, since ``http.server``
    instantiates handlers itself): requests read against ``client_timeout``, rewritten by ``prioritizer``."""
    host, port, base = _split_upstream(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        default_request_version = "HTTP/1.0"  # an unparsable request line still gets a status line
        disable_nagle_algorithm = True  # else a small last write waits ~40 ms for the client's delayed ACK
        timeout = client_timeout  # per write to the client; reads have the request's deadline

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the socket's own reader, replaced by one that keeps a deadline
            self.reader = _ClientReader(self.connection)
            self.rfile = io.BufferedReader(self.reader)

        def handle_one_request(self) -> None:
            self.reader.deadline = time.monotonic() + client_timeout
            super().handle_one_request()

        def log_message(self, format, *args):  # access log at debug level, not on stderr
            log.debug("%s " + format, self.address_string(), *args)

        def _forward(self) -> None:
            try:
                if not self.path.startswith("/"):  # absolute-form or "*": the proxy is no forward proxy
                    raise BadRequest(400, "the request target is not a path; send e.g. /v1/completions")
                raw = self._read_body()
            except BadRequest as err:
                self._error(err.status, str(err), close=True)
                return
            self._request_read()
            if self.command == "POST":
                raw = prioritizer.rewrite(self.path, raw)
            headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
            conn = http.client.HTTPConnection(host, port, timeout=UPSTREAM_TIMEOUT)
            try:  # before connecting: a path or header that the upstream request cannot carry is the client's
                conn.putrequest(
                    self.command,
                    base + self.path,
                    skip_accept_encoding=any(k.lower() == "accept-encoding" for k, _ in headers),
                )
                for k, v in headers:
                    conn.putheader(k, v)
                conn.putheader("Content-Length", str(len(raw)))
            except (ValueError, http.client.HTTPException) as err:
                self._error(400, f"the request cannot be forwarded ({type(err).__name__}: {err})", close=True)
                return
            try:
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as err:
                conn.close()
                self._error(502, f"upstream {upstream} unreachable ({type(err).__name__}: {err})")
                return
            self.server.hangups.watch(self.connection, conn.sock)
            try:
                failure = self._relay(conn, raw)
            finally:
                hung_up = self.server.hangups.unwatch(self.connection)
                conn.close()
            if hung_up:
                log.info(
                    "%s %s: the client hung up; its upstream request was closed", self.command, self.path
                )
                self.close_connection = True
            elif failure:
                self._error(502, failure)

        def _relay(self, conn: http.client.HTTPConnection, raw: bytes) -> str | None:
            """Sends the request upstream and streams the reply back.  Returns why the upstream failed before
            its reply began (for a 502), else None: a failure once the reply is on its way cuts it short."""
            try:
                conn.endheaders(raw)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as err:
                return f"upstream {upstream} failed ({type(err).__name__}: {err})"
            chunked = self.request_version == "HTTP/1.1"  # an HTTP/1.0 client gets the body up to the close
            try:
                self.log_request(resp.status)
                self.send_response_only(resp.status, resp.reason)  # the upstream's Server and Date, not ours
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
            except (OSError, http.client.HTTPException):
                self.close_connection = True  # a side went away mid-reply: the client sees it cut short
            return None

        def _read_body(self) -> bytes:
            """The request body: ``Content-Length`` bytes, or a chunked body de-chunked (forwarded with its
            length).  Raises ``BadRequest`` on anything else, ``ConnectionAbortedError`` if the client leaves."""
            codings = [
                c.strip().lower() for v in self.headers.get_all("Transfer-Encoding", []) for c in v.split(",")
            ]
            lengths = self.headers.get_all("Content-Length", [])
            if codings:
                if lengths:  # the two framings disagreeing is how requests are smuggled past a proxy
                    raise BadRequest(400, "both Transfer-Encoding and Content-Length; send one")
                if codings != ["chunked"]:
                    raise BadRequest(400, f"transfer coding {', '.join(codings)!r} unsupported; send chunked")
                return self._read_chunked()
            if not lengths:
                return b""
            text = lengths[0].strip() if len(lengths) == 1 else ""
            if not _DIGITS.fullmatch(text):
                raise BadRequest(
                    400, f"Content-Length {', '.join(lengths)[:40]!r} is not one non-negative integer"
                )
            if len(text) > 18 or int(text) > MAX_BODY:  # int() refuses over 4,300 digits
                raise BadRequest(
                    413, f"request body of {text[:20]} bytes is over {MAX_BODY}; send a smaller one"
                )
            return self._read(int(text))

        def _read_chunked(self) -> bytes:
            parts, total = [], 0
            while size := self._chunk_size():
                total += size
                if total > MAX_BODY:
                    raise BadRequest(413, f"chunked request body over {MAX_BODY} bytes; send a smaller one")
                data = self._read(size + 2)
                if data[-2:] != b"\r\n":
                    raise BadRequest(400, "chunk data longer than its size")
                parts.append(data[:-2])
            for _ in range(MAX_TRAILERS):  # trailer fields, dropped
                if self._line().strip() == b"":
                    return b"".join(parts)
            raise BadRequest(400, f"over {MAX_TRAILERS} trailer lines")

        def _chunk_size(self) -> int:
            text = self._line().split(b";", 1)[0].strip()
            if not _HEX.fullmatch(text):
                raise BadRequest(400, f"chunk size {text[:20]!r} is not a hex number")
            return int(text, 16)  # any size: the running total against MAX_BODY refuses a huge one

        def _line(self) -> bytes:
            line = self.rfile.readline(MAX_LINE + 1)
            if len(line) > MAX_LINE:
                raise BadRequest(400, f"a chunked-body line over {MAX_LINE} bytes")
            if not line.endswith(b"\n"):
                raise ConnectionAbortedError("the client closed mid-body")
            return line

        def _read(self, n: int) -> bytes:
            data = self.rfile.read(n)
            if len(data) < n:
                raise ConnectionAbortedError("the client closed mid-body")
            return data

        def _request_read(self) -> None:
            """The request is in: what follows is the upstream's time, not the client's."""
            self.reader.deadline = None
            self.connection.settimeout(client_timeout)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The standard library's refusals (request line, version, header block, method) in the proxy's
            JSON form, and closing like every refusal."""
            self._error(code, message or HTTPStatus(code).phrase, close=True)

        def _error(self, status: int, message: str, close: bool = False) -> None:
            message = message[:300]  # a refused request line can be 64 KiB
            log.warning("%s %s: %d %s", self.command, getattr(self, "path", "")[:200], status, message)
            self._request_read()
            payload = json.dumps(
                {"error": {"message": message, "type": "proxy_error", "code": status}}
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if close:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
            if close:
                self._linger()

        def _linger(self) -> None:
            """Half-closes, then reads and drops what the client still sends for up to ``LINGER`` seconds:
            closing a socket with unread bytes resets the connection, which can discard the answer before the
            client has read it."""
            try:
                self.connection.shutdown(socket.SHUT_WR)
                deadline = time.monotonic() + LINGER
                while (left := deadline - time.monotonic()) > 0:
                    self.connection.settimeout(left)
                    if not self.connection.recv(65536):
                        break
            except OSError:
                pass  # reset, or still sending at the deadline: closed either way

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    return Handler


class ProxyServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` at once: the next are answered 503 from the
    accepting thread (without a thread of their own), so a flood of connections cannot exhaust threads.
    ``open_connections`` and ``refused`` count them."""

    daemon_threads = True
    request_queue_size = 1024  # a burst of a few hundred connections must not be refused

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS):
        if max_connections < 1:
            raise ValueError(f"max_connections {max_connections} is not positive; to resolve, pass 1 or more")
        super().__init__(address, handler)
        self.max_connections, self.open_connections, self.refused = max_connections, 0, 0
        self._count = threading.Lock()
        self.hangups = _HangupWatch()

    def process_request(self, request, client_address) -> None:
        with self._count:
            full = self.open_connections >= self.max_connections
            if full:
                self.refused += 1
            else:
                self.open_connections += 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._count:
            self.open_connections -= 1

    def _refuse(self, request: socket.socket) -> None:
        """A 503 without blocking the accepting thread: what the client sent so far is read first (closing on
        unread bytes would reset the connection and could discard the answer), the answer fits a socket buffer."""
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood logs a few lines
            log.warning("%d connections over the cap of %d answered 503", self.refused, self.max_connections)
        payload = json.dumps({"error": {"message": "too many connections; retry", "type": "proxy_error",
                                        "code": 503}}).encode()  # fmt: skip
        try:
            request.setblocking(False)
            try:
                request.recv(65536)
            except BlockingIOError:
                pass
            request.send(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
            )
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A client that resets, leaves or times out is routine (a debug line); anything else is a bug, logged
        with its traceback (the standard library prints it on stderr)."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            log.debug("connection from %s: %s: %s", client_address, type(err).__name__, err)
        else:
            log.error("connection from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        self.hangups.close()


def check_upstream_priority(upstream: str, timeout: float = PROBE_TIMEOUT) -> None:
    """Raises ``UsageError`` unless ``upstream`` serves a completion with a non-zero priority.

    A vLLM server started without ``--scheduling-policy priority`` answers 400 to every such request, so a proxy
    in front of it would turn all scored traffic into errors.  The probe: the first model of ``/v1/models``,
    one token of a two-letter prompt, priority ``PROBE_PRIORITY``."""
    host, port, base = _split_upstream(upstream)
    anyway = "or pass --skip-upstream-check (check_upstream=False) to start anyway"

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request(
                method, base + path, json.dumps(body) if body else None, {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            return resp.status, resp.read().decode("utf-8", "replace")
        finally:
            conn.close()

    try:
        status, text = call("GET", "/v1/models")
        try:
            model = json.loads(text)["data"][0]["id"] if status == 200 else None
        except (ValueError, LookupError, TypeError):
            model = None
        if model is None:
            raise UsageError(f"upstream {upstream} lists no model at /v1/models ({status}); to resolve, point "
                             f"--upstream at a vLLM server, {anyway}")  # fmt: skip
        probe = {"model": model, "prompt": "Hi", "max_tokens": 1, "priority": PROBE_PRIORITY}
        status, text = call("POST", "/v1/completions", probe)
    except (OSError, http.client.HTTPException) as err:
        raise UsageError(f"upstream {upstream} unreachable ({type(err).__name__}: {err}); to resolve, start it "
                         f"first, {anyway}") from None  # fmt: skip
    if status == 200:
        return
    said = " ".join(text.split())[:300]
    if status == 400 and "priority" in said.lower():
        raise UsageError(f"upstream {upstream} refuses request priorities ({said}); to resolve, start vLLM with "
                         f"--scheduling-policy priority, {anyway}")  # fmt: skip
    raise UsageError(f"upstream {upstream} answered a one-token completion with {status} ({said}); to resolve, "
                     f"check that it serves /v1/completions, {anyway}")  # fmt: skip


def make_server(
    ranker_dir,
    upstream: str,
    host: str = "127.0.0.1",
    port: int = 8100,
    scale: float = 1000.0,
    oracle: bool = False,
    *,
    max_connections: int = MAX_CONNECTIONS,
    client_timeout: float = CLIENT_TIMEOUT,
    check_upstream: bool = True,
    honour_client_priority: bool = False,
    aging_s: float | None = AGING_S,
) -> ProxyServer:
    """The proxy server (not started): ``serve_forever()`` it, or ``serve`` for the CLI.  Raises ``UsageError``
    if the upstream refuses priorities (``check_upstream``), before binding or loading the ranker."""
    if check_upstream:
        check_upstream_priority(upstream)
    prioritizer = Prioritizer(ranker_dir, scale, oracle, honour_client_priority, aging_s)
    handler = make_handler(prioritizer, upstream, client_timeout)
    server = ProxyServer((host, port), handler, max_connections)
    server.prioritizer = prioritizer
    return server


def serve(
    ranker_dir,
    upstream: str,
    host: str = "127.0.0.1",
    port: int = 8100,
    scale: float = 1000.0,
    oracle: bool = False,
    **options,
) -> None:
    """Runs the proxy until interrupted; ``options`` as for ``make_server``."""
    server = make_server(ranker_dir, upstream, host, port, scale, oracle, **options)
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
