"""The ranking proxy in front of a real vLLM CPU server started with ``--scheduling-policy priority``: a
streamed completion and a chat completion pass through with the ranker's priorities (a FCFS server refuses a
non-zero priority with a 400, so a 200 here means the priority reached a priority scheduler).  The server's
port is held by the test from before the server starts until it ends (``helpers.faults.reserve_port``: vLLM binds
it with SO_REUSEADDR too), so no other process can take it in between; the proxy listens on port 0."""

import http.client
import json
import os
import subprocess
import threading
import time
import urllib.request

import pytest
from helpers import ROOT
from helpers.faults import reserve_port

from eval.serving.ranking.labels import sharegpt_lengths
from eval.serving.ranking.proxy import make_server
from eval.serving.ranking.train import TrainConfig, train_ranker
from eval.serving.vllm.cpu import cpu_environment


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.smollm2
def test_proxy_in_front_of_vllm(smollm2, sharegpt, vllm_python, tmp_path):
    sharegpt_lengths(smollm2, tmp_path / "lengths", records="train", limit=300)
    ranker = train_ranker(tmp_path / "lengths", tmp_path / "ranker", TrainConfig(kind="ngram", ngram_bits=16))
    env = {**os.environ, **cpu_environment(tmp_path), "PYTHONPATH": str(ROOT)}
    held = reserve_port()  # until the end: the server binds it with SO_REUSEADDR, nothing else can meanwhile
    port = held.getsockname()[1]
    cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2), "--enforce-eager",
           "--dtype", "float32", "--kv-cache-memory-bytes", str(128 << 20), "--max-model-len", "1024",
           "--scheduling-policy", "priority", "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    proxy = None
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up in 600 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                time.sleep(1)
        # started once the server is up: its start-up check sends the server a request with a priority
        proxy = make_server(ranker, f"http://127.0.0.1:{port}", port=0)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=300)
        body = {
            "model": "m",
            "prompt": "Write a long essay about cats.",
            "max_tokens": 6,
            "ignore_eos": True,
            "stream": True,
        }
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        assert resp.status == 200, text
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 7  # one event per token, then DONE
        chat = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        conn.request("POST", "/v1/chat/completions", json.dumps(chat), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] <= 4
        assert proxy.prioritizer.failures == 0
    finally:
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()
        os.killpg(server.pid, 9)
        server.wait(timeout=60)
        log.close()
        held.close()
