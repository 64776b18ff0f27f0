"""A fake vLLM behind the ranking proxy, and raw-socket clients for what well-behaved HTTP clients never send.

The upstream records each request and, asked to ``hold``, watches its own connection the way vLLM aborts a request
whose client went away; it can also refuse ``priority`` the way a vLLM started without
``--scheduling-policy priority`` does."""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FCFS_REFUSAL = {
    "object": "error",
    "message": "Got priority 1 but Priority scheduling is not enabled.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}


class FakeUpstream(BaseHTTPRequestHandler):
    """Records each POST in ``seen``; `"stream": true` streams two SSE events 0.4 s apart, else one JSON body.

    `"hold": s` (a body field) keeps the reply back for ``s`` seconds after the first event (streamed) or before
    the body (not streamed), watching the connection: a proxy that closes it first is recorded in ``aborted``
    (seconds after the request arrived), a reply sent in full in ``finished``.  ``refuse_priority`` answers a
    non-zero priority with vLLM's FCFS 400.  A subclass per server (``fake_upstream``) keeps the records apart."""

    protocol_version = "HTTP/1.1"
    seen: list
    aborted: list
    finished: list
    refuse_priority = False

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply(200, b'{"data": [{"id": "m"}]}')

    def do_POST(self):
        arrived = time.monotonic()
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.path, raw, dict(self.headers)))
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            self._reply(400, b'{"error": "bad json"}')
            return
        if self.refuse_priority and body.get("priority"):
            self._reply(400, json.dumps(FCFS_REFUSAL).encode())
            return
        hold = body.get("hold", 0)
        if not body.get("stream"):
            if self._held(hold, arrived):
                self._reply(200, b'{"choices": [{"text": "ok"}]}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, event in enumerate([b'data: {"text": "a"}\n\n', b"data: [DONE]\n\n"]):
            if i:
                if not self._held(hold, arrived):
                    return
                time.sleep(0.4)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _held(self, seconds: float, arrived: float) -> bool:
        """Waits ``seconds`` unless the peer closes first (then records it and returns False)."""
        deadline = arrived + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.connection], [], [], min(left, 0.02))[0]:
                try:
                    closed = self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    closed = True
                if closed:
                    self.aborted.append(time.monotonic() - arrived)
                    self.close_connection = True
                    return False
        if seconds:
            self.finished.append(time.monotonic() - arrived)
        return True

    def _reply(self, status, payload):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A proxy that hangs up mid-reply is what some tests do; anything else is the fake's bug, loud."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def fake_upstream(refuse_priority: bool = False) -> ThreadingHTTPServer:
    """A started ``FakeUpstream`` on a free loopback port, with records of its own (``server.handler.seen``)."""
    handler = type(
        "Upstream",
        (FakeUpstream,),
        {"seen": [], "aborted": [], "finished": [], "refuse_priority": refuse_priority},
    )
    server = start(_Server(("127.0.0.1", 0), handler))
    server.handler = handler
    return server


def start(server):
    """``server`` serving in a daemon thread that checks for ``shutdown`` every 20 ms (socketserver's default, 0.5 s,
    made every stop of a proxy and its fake upstream wait up to a second)."""
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


def stop(server) -> None:
    server.shutdown()
    server.server_close()


def exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    """Sends ``data`` on a fresh loopback connection and reads until the proxy closes it or ``timeout``
    passes: what came back and the seconds it took (``timeout`` or more: the proxy kept the connection)."""
    begin = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            pass
    return received, time.monotonic() - begin


def statuses(received: bytes) -> list[int]:
    """The status codes of the HTTP responses in ``received``, in order."""
    return [int(line.split()[1]) for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.")]
