"""The ranking proxy over real HTTP against a small fake upstream: priorities from the ranker, streaming that
passes through as it is produced, FCFS fallback on every kind of ranker failure, errors, loopback binding."""

import http.client
import json
import time

import pytest
from helpers.ranking_proxy import fake_upstream, start, stop

from eval.serving.ranking.proxy import Prioritizer, _encoder, make_server, overhead_ms, prompt_of


@pytest.fixture(scope="module")
def upstream():
    server = fake_upstream()
    yield server
    stop(server)


@pytest.fixture()
def proxy(ranker_dir, upstream):
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    server = start(make_server(ranker_dir, url, port=0, aging_s=None))  # aging: test_aging_*
    yield server
    stop(server)


def post(server, path, body, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request(
        "POST",
        path,
        body=raw if raw is not None else json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    return conn, conn.getresponse()


def last_body(upstream):
    """The body of the last request that reached the upstream."""
    return json.loads(upstream.handler.seen[-1][1])


def test_priority_orders_by_predicted_length(proxy, upstream):
    assert proxy.server_address[0] == "127.0.0.1"
    priorities = {}
    for prompt in ["short tell me now", "essay about cats and dogs please"]:
        _, resp = post(proxy, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 8})
        assert resp.status == 200 and json.loads(resp.read()) == {"choices": [{"text": "ok"}]}
        body = last_body(upstream)
        assert body["prompt"] == prompt and body["max_tokens"] == 8
        priorities[prompt] = body["priority"]
    assert priorities["short tell me now"] < priorities["essay about cats and dogs please"]  # lower = sooner
    _, resp = post(
        proxy, "/v1/chat/completions", {"messages": [{"role": "user", "content": "short tell me now"}]}
    )
    resp.read()
    assert last_body(upstream)["priority"] == priorities["short tell me now"]
    _, resp = post(proxy, "/v1/completions", {"prompt": "short tell me now", "priority": -5})
    resp.read()
    assert last_body(upstream)["priority"] == priorities["short tell me now"]  # a client's own is ignored


def test_streaming_passes_through(proxy):
    start_t = time.monotonic()
    _, resp = post(proxy, "/v1/completions", {"prompt": "how now", "stream": True})
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    first = resp.read1(1 << 16)
    first_t = time.monotonic() - start_t
    rest = resp.read()
    assert first.startswith(b'data: {"text": "a"}') and first_t < 0.35  # before the upstream's second event
    assert (first + rest).endswith(b"data: [DONE]\n\n")


def test_ranker_failures_fall_back_to_fcfs(proxy, ranker_dir, upstream, tmp_path, caplog):
    fallback = proxy.prioritizer.aged(
        proxy.prioritizer.fallback
    )  # the training mean: a constant without aging
    _, resp = post(proxy, "/v1/completions", {"prompt": {"not": "a prompt"}})
    resp.read()
    assert resp.status == 200 and last_body(upstream)["priority"] == fallback
    _, resp = post(proxy, "/v1/completions", None, raw=b"{not json")
    assert (
        resp.status == 400 and upstream.handler.seen[-1][1] == b"{not json"
    )  # forwarded as is, upstream answers
    assert proxy.prioritizer.failures == 2
    broken = make_server(
        tmp_path / "missing", f"http://127.0.0.1:{upstream.server_address[1]}", port=0, aging_s=None
    )
    start(broken)
    try:
        for prompt in ["short", "essay about cats"]:
            _, resp = post(broken, "/v1/completions", {"prompt": prompt})
            assert resp.status == 200 and json.loads(resp.read())
            assert last_body(upstream)["priority"] == 0  # one constant: arrival order
    finally:
        stop(broken)
    assert "not loaded" in caplog.text and "ranker failed" in caplog.text


def test_passthrough_and_upstream_errors(proxy, ranker_dir):
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=10)
    conn.request("GET", "/v1/models")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["data"][0]["id"] == "m"
    conn.request("GET", "/v1/models")  # the same keep-alive connection
    assert conn.getresponse().status == 200
    dead = start(make_server(ranker_dir, "http://127.0.0.1:9", port=0, check_upstream=False))
    try:
        _, resp = post(dead, "/v1/completions", {"prompt": "short"})
        assert resp.status == 502 and "unreachable" in json.loads(resp.read())["error"]["message"]
    finally:
        stop(dead)
    with pytest.raises(ValueError, match="http://"):
        make_server(ranker_dir, "127.0.0.1:8000", port=0)


def test_prompt_shapes():
    assert prompt_of("/v1/completions", {"prompt": ["one"]}) == "one"
    assert prompt_of("/v1/completions", {"prompt": [3, 4, 5]}) == [3, 4, 5]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_of("/v1/chat/completions", parts) == "hi"
    for bad in [{"prompt": ["a", "b"]}, {"prompt": [1.5]}, {}]:
        with pytest.raises(ValueError):
            prompt_of("/v1/completions", bad)


def test_token_ids_are_scored_like_text(ranker_dir):
    p = Prioritizer(ranker_dir, aging_s=None)
    ids = p.ranker.tokenizer("short tell me").input_ids
    assert p.priority("/v1/completions", {"prompt": ids}) == p.priority(
        "/v1/completions", {"prompt": "short tell me"}
    )


def test_overhead_is_small(ranker_dir):
    """Wall clock through the relay, not only `rewrite`: a small last write held back by Nagle's algorithm until
    the client's delayed ACK cost ~40 ms per request before the proxy's sockets set TCP_NODELAY."""
    result = overhead_ms(ranker_dir, prompt_tokens=1000, repeats=30)
    assert result["prompt_tokens"] >= 900 and result["failures"] == 0
    assert result["overhead_ms_p50"] < 20  # ~2 ms idle; generous for shared CPUs, far below the 40 ms stall
    assert result["direct_ms_p50"] < result["proxied_ms_p50"]
    assert 0 < result["rewrite_cpu_ms_p50"] <= result["rewrite_cpu_ms_p90"]


def test_encoder_matches_the_tokenizer_without_its_lock(tokenizer_dir):
    """The proxy's lock-free encoder gives `tokenizer(text).input_ids`, also when the tokenizer's own backend is
    set to truncate (the wrapper turns that off per call) and for a tokenizer without a Rust backend."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.backend_tokenizer.enable_truncation(3)
    encode = _encoder(tokenizer)
    for text in ["short tell me now", "essay about cats and dogs please " * 50, "", "unknown words here"]:
        assert encode(text) == tokenizer(text).input_ids
    assert len(encode("essay about cats and dogs please " * 50)) == 300

    class PythonOnly:
        def __call__(self, text):
            return tokenizer(text)

    assert _encoder(PythonOnly())("tell me about cats") == tokenizer("tell me about cats").input_ids


def test_oracle_mode_uses_max_tokens():
    p = Prioritizer(None, oracle=True)
    assert p.priority("/v1/completions", {"prompt": "x", "max_tokens": 37}) == 37
    assert p.priority("/v1/completions", {"prompt": "x"}) == 0


def test_aging_priority_is_log_length_plus_arrival_over_aging_s(ranker_dir):
    """priority = round((predicted log length + seconds since start / aging_s) * scale): a request that arrived
    aging_s * (log difference) earlier ties a later one predicted shorter, earlier still outranks it; clipped to
    vLLM's int range; unscored requests age alike."""
    import numpy as np

    clock = type("Clock", (), {"t": 100.0, "__call__": lambda self: self.t})()
    p = Prioritizer(ranker_dir, scale=1000.0, aging_s=30.0, clock=clock)
    short, long_ = {"prompt": "short tell me now"}, {"prompt": "essay about cats and dogs please"}
    log_short, log_long = (-float(p.ranker.score([b["prompt"]])[0]) for b in (short, long_))
    assert log_long > log_short
    assert p.priority("/v1/completions", long_) == round(log_long * 1000)  # arrival 0: the epoch
    clock.t += 12.0
    assert p.priority("/v1/completions", short) == round((log_short + 12.0 / 30.0) * 1000)
    gap = 30.0 * (log_long - log_short)  # waiting this long makes up the predicted difference
    clock.t = 100.0 + gap + 0.5
    early_long = round(log_long * 1000)
    assert p.priority("/v1/completions", short) > early_long  # the long one that waited is served first
    clock.t = 100.0 + gap - 0.5
    assert p.priority("/v1/completions", short) < early_long  # before that, the short one jumps it
    assert p.priority("/v1/completions", {"prompt": {"bad": 1}}) == round(
        (p.fallback + (gap - 0.5) / 30) * 1000
    )
    clock.t = 1e12
    assert p.priority("/v1/completions", short) == 2**31 - 1
    assert Prioritizer(ranker_dir, aging_s=None, clock=clock).priority("/v1/completions", short) == round(
        log_short * 1000
    )
    with pytest.raises(ValueError, match="aging_s"):
        Prioritizer(ranker_dir, aging_s=0.0)
    assert np.isclose(p.fallback, p.ranker.ngram.bias)


def test_cli_proxy_overhead(ranker_dir, tmp_path, capsys):
    from eval.serving.ranking.cli import main

    assert main(["proxy-overhead", str(ranker_dir), "--repeats", "0"]) == 2
    assert "not a positive integer" in capsys.readouterr().err
    out = tmp_path / "overhead.json"
    assert (
        main(
            ["proxy-overhead", str(ranker_dir), "--prompt-tokens", "50", "--repeats", "5", "--out", str(out)]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and 40 <= printed["prompt_tokens"] <= 50
