"""The ranking proxy against hostile and careless clients, over loopback, with a fake vLLM behind it: every
malformed request answered with a 4xx (or a closed connection) within seconds and no traceback, chunked bodies
relayed whole, a bound on connections and on how long a client may take, a client's disconnect closing the
upstream request, the start-up check of the upstream's priority scheduling, the client-priority policy, and a few
hundred hostile requests after which a normal one is still relayed correctly."""

import http.client
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.ranking_proxy import exchange, fake_upstream, start, statuses, stop

from eval.serving.ranking.proxy import MAX_BODY, make_server
from toolkit.cliargs import UsageError

BODY = json.dumps({"model": "m", "prompt": "short tell me now", "max_tokens": 3}).encode()


@pytest.fixture()
def upstream():
    server = fake_upstream()
    yield server
    stop(server)


def url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture()
def proxy_for(ranker_dir, upstream):
    """``proxy_for(**options)``: a started proxy in front of ``upstream``, stopped after the test."""
    servers = []

    def make(**options):
        servers.append(start(make_server(ranker_dir, url(upstream), port=0, **options)))
        return servers[-1]

    yield make
    for server in servers:
        stop(server)


def post_head(length: bytes | None = None, *extra: bytes, path: bytes = b"/v1/completions") -> bytes:
    """A POST's request line and headers (``Content-Length: length`` unless None, then ``extra`` lines)."""
    lines = [b"POST " + path + b" HTTP/1.1", b"Host: proxy", b"Content-Type: application/json"]
    lines += [b"Content-Length: " + length] if length is not None else []
    return b"\r\n".join([*lines, *extra]) + b"\r\n\r\n"


def chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailer + b"\r\n"


def test_chunked_request_bodies_are_relayed_whole(proxy_for, upstream):
    proxy = proxy_for(client_timeout=1)
    port = proxy.server_address[1]
    head = post_head(None, b"Transfer-Encoding: chunked", b"Connection: close")
    received, _ = exchange(port, head + chunked(BODY[:10], BODY[10:], trailer=b"X-Trailer: t\r\n"))
    assert statuses(received) == [200]
    _, raw, headers = upstream.handler.seen[-1]
    forwarded = json.loads(raw)
    assert forwarded["prompt"] == "short tell me now" and isinstance(forwarded["priority"], int)
    assert headers["Content-Length"] == str(len(raw)) and "Transfer-Encoding" not in headers
    bad = {
        b"zz\r\n": 400,  # not a hex size
        b"5\r\nabcdefg\r\n0\r\n\r\n": 400,  # the data runs past its size
        b"%x\r\n" % (MAX_BODY + 1): 413,
        chunked(b"a" * 40) + b"GET /v1/models HTTP/1.1\r\n\r\n": 400,  # not JSON; then a second request
    }
    for body, status in bad.items():
        received, took = exchange(port, post_head(None, b"Transfer-Encoding: chunked") + body)
        assert statuses(received)[:1] == [status] and took < 3, (body, received)
    for te in [b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked\r\nContent-Length: 5"]:
        received, took = exchange(port, post_head(None, te) + chunked(BODY))
        assert statuses(received) == [400] and took < 3, (te, received)


@pytest.mark.parametrize(
    "length", [b"-1", b"abc", b"1e3", b"+5", b"5, 6", b"0x10", b"5\r\nContent-Length: 6", b"\xb9"]
)
def test_bad_content_lengths_are_400(proxy_for, length):
    proxy = proxy_for(client_timeout=2)
    received, took = exchange(proxy.server_address[1], post_head(length) + BODY)
    assert statuses(received) == [400] and took < 3, received
    assert b"Connection: close" in received


def test_an_over_size_body_is_413_and_never_parsed_as_a_request(proxy_for, upstream):
    proxy = proxy_for(client_timeout=2)
    smuggled = b"GET /v1/smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    for length in [b"%d" % (MAX_BODY + 1), b"9" * 5000]:  # 5,000 digits: more than int() parses
        received, took = exchange(proxy.server_address[1], post_head(length) + smuggled)
        assert statuses(received) == [413] and took < 3, received
    assert not any(path == "/v1/smuggled" for path, *_ in upstream.handler.seen)


def test_requests_the_upstream_cannot_be_sent_are_400(proxy_for, upstream, caplog):
    """A control character in the path (http.client refuses to send it), a target that is not a path, JSON
    nested past the stack: a 4xx or the body forwarded as is, never an exception in the handler."""
    proxy = proxy_for(client_timeout=1)
    port = proxy.server_address[1]
    for line in [b"GET /\x01 HTTP/1.1", b"GET http://example.com/v1/models HTTP/1.1", b"GET * HTTP/1.1"]:
        received, took = exchange(port, line + b"\r\nHost: x\r\n\r\n")
        assert statuses(received) == [400] and took < 3, (line, received)
    deep = b"[" * 100_000
    received, took = exchange(port, post_head(b"%d" % len(deep), b"Connection: close") + deep)
    assert statuses(received) == [400] and upstream.handler.seen[-1][1] == deep  # the upstream's answer
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_slow_and_silent_clients_are_dropped(proxy_for):
    proxy = proxy_for(client_timeout=1)
    port = proxy.server_address[1]
    assert exchange(port, b"", timeout=5)[1] < 2.5  # an idle connection
    received, took = exchange(port, post_head(b"100") + b'{"prompt"', timeout=5)  # half a body
    assert took < 2.5 and statuses(received) in ([], [408])
    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:  # slow loris: a byte at a time
        begin, closed = time.monotonic(), False
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        while not closed and time.monotonic() - begin < 6:
            try:
                sock.sendall(b"X")
                sock.recv(1024)  # an answer or EOF: dropped
                closed = True
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed and time.monotonic() - begin < 2.5


def test_connections_beyond_the_cap_get_503(proxy_for):
    proxy = proxy_for(max_connections=2, client_timeout=5)
    port = proxy.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    time.sleep(0.2)
    received, took = exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert statuses(received) == [503] and took < 2, received
    idle.pop().close()
    deadline = time.monotonic() + 3
    while True:  # the slot comes back once the proxy has seen the close
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/v1/models")
        status = conn.getresponse().status
        conn.close()
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200
    idle.pop().close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_disconnect_aborts_the_upstream_request(proxy_for, upstream, stream):
    proxy = proxy_for(client_timeout=2)
    body = json.dumps({"prompt": "short tell me now", "hold": 5, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", proxy.server_address[1]), timeout=5) as sock:
        sock.sendall(post_head(b"%d" % len(body)) + body)
        if stream:
            received = b""
            while b"data:" not in received:  # the first event; the upstream holds the rest back
                received += sock.recv(65536)
        else:
            deadline = time.monotonic() + 3
            while not upstream.handler.seen and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
    closed = time.monotonic()
    while not upstream.handler.aborted and time.monotonic() - closed < 3:
        time.sleep(0.02)
    assert upstream.handler.aborted and not upstream.handler.finished
    assert upstream.handler.aborted[0] < 2  # of a 5 s hold


def test_startup_check_of_the_upstreams_priority_scheduling(ranker_dir, upstream, capsys):
    from eval.serving.ranking.cli import main

    fcfs = fake_upstream(refuse_priority=True)
    try:
        with pytest.raises(UsageError, match="--scheduling-policy priority"):
            make_server(ranker_dir, url(fcfs), port=0)
        assert main(["proxy", str(ranker_dir), "--upstream", url(fcfs), "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1 and "--scheduling-policy priority" in err and "--skip-upstream-check" in err
        )
        make_server(ranker_dir, url(fcfs), port=0, check_upstream=False).server_close()
    finally:
        stop(fcfs)
    make_server(ranker_dir, url(upstream), port=0).server_close()
    probe = json.loads(upstream.handler.seen[-1][1])
    assert probe["priority"] != 0 and probe["max_tokens"] == 1 and probe["model"] == "m"
    with pytest.raises(UsageError, match="unreachable"):
        make_server(ranker_dir, "http://127.0.0.1:9", port=0)


def test_client_priority_is_ignored_unless_honoured(proxy_for, upstream):
    body = {"prompt": "essay about cats and dogs please", "priority": -5}
    for honour in (False, True):
        proxy = proxy_for(honour_client_priority=honour, aging_s=None)  # the same priority twice
        conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=5)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        assert conn.getresponse().read()
        ranked = proxy.prioritizer.priority("/v1/completions", body)
        assert ranked > -5 and json.loads(upstream.handler.seen[-1][1])["priority"] == (
            -5 if honour else ranked
        )
        conn.close()


def hostile_requests(count: int, seed: int = 0) -> list[tuple[bytes, bool]]:
    """``count`` (bytes, close at once) pairs: malformed request lines, bad headers and lengths, garbage, bodies
    cut short, chunked bodies gone wrong, and requests whose client leaves before the answer."""
    rng = random.Random(seed)
    hold = json.dumps({"prompt": "short", "hold": 0.5}).encode()
    fixed = [
        b"GARBAGE\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET / HTTP/1.1 extra\r\n\r\n",
        b"GET /\x01 HTTP/1.1\r\n\r\n",
        b"GET /\x7f\x00 HTTP/1.1\r\n\r\n",
        b"GET http://example.com/ HTTP/1.1\r\n\r\n",
        b"GET * HTTP/1.1\r\n\r\n",
        post_head(b"100000") + b"[" * 100000,
        b"BREW /v1/models HTTP/1.1\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"X: a\r\n" * 120 + b"\r\n",
        b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n",
        b"GET / HTTP/1.1\r\n\xff\xfe: \xfd\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nConnection: keep-alive, upgrade\r\nUpgrade: h2c\r\n\r\n",
        post_head(b"-1") + BODY,
        post_head(b"abc") + BODY,
        post_head(b"99999999999999999999999999") + BODY,
        post_head(b"%d" % (MAX_BODY + 1)) + BODY,
        post_head(b"5", b"Content-Length: 6") + BODY,
        post_head(b"100") + BODY[:20],
        post_head(b"3") + BODY,
        post_head(b"%d" % len(BODY), b"Expect: 100-continue"),
        post_head(None, b"Transfer-Encoding: chunked") + b"zz\r\n",
        post_head(None, b"Transfer-Encoding: chunked") + b"%x\r\n" % (MAX_BODY + 1),
        post_head(None, b"Transfer-Encoding: chunked") + b"5\r\nab",
        post_head(None, b"Transfer-Encoding: chunked") + chunked(BODY)[:-2],
        post_head(None, b"Transfer-Encoding: chunked") + b"1\r\na\r\n" * 3000,
        post_head(None, b"Transfer-Encoding: chunked, gzip") + chunked(BODY),
        post_head(b"%d" % len(b"{not json"), path=b"/v1/chat/completions") + b"{not json",
        post_head(b"%d" % len(b"[1, 2]")) + b"[1, 2]",
        post_head(b"%d" % len(hold)) + hold,  # the client leaves while the upstream holds the reply
    ]
    cases = [(data, close) for data in fixed for close in (False, True)]
    valid = post_head(b"%d" % len(BODY)) + BODY
    while len(cases) < count:
        kind = rng.randrange(3)
        if kind == 0:  # garbage bytes
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        elif kind == 1:  # a valid request cut anywhere
            data = valid[: rng.randrange(1, len(valid))]
        else:  # a valid request with bytes flipped
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        cases.append((data, rng.random() < 0.3))
    return cases


def test_hostile_requests_then_a_normal_one(proxy_for, upstream, capfd, caplog):
    proxy = proxy_for(client_timeout=1, max_connections=64)
    port = proxy.server_address[1]
    cases = hostile_requests(300)

    def send(case: tuple[bytes, bool]) -> tuple[bytes, float]:
        data, close = case
        if close:  # sends and leaves without reading
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                try:
                    sock.sendall(data)
                except OSError:
                    pass
            return b"", 0.0
        return exchange(port, data, timeout=4)

    begin = time.monotonic()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(send, cases))
    assert time.monotonic() - begin < 60
    for (data, _), (received, took) in zip(cases, results, strict=True):
        assert took < 3, (data[:80], received[:200])  # answered and closed (or dropped) within the timeout
        assert not received or received.startswith(b"HTTP/1."), (data[:80], received[:200])
        assert all(s < 500 or s in (501, 503, 505) for s in statuses(received)), (data[:80], received[:300])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"choices": [{"text": "ok"}]}
    forwarded = json.loads(upstream.handler.seen[-1][1])
    assert forwarded == {**json.loads(BODY), "priority": forwarded["priority"]}
    conn.close()
    deadline = time.monotonic() + 3
    while proxy.open_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proxy.open_connections == 0
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
