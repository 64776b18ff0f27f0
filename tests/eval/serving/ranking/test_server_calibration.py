"""`ranking calibrate --server`: the cost model fitted from a server's token streams recovers the step times of a
fake vLLM (an engine thread that batches every running request into steps of known duration and streams one
token per step, behind a fixed per-request overhead); refusals in one line before any work, and when the server
cannot run a batch at once."""

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eval.serving.ranking.cli import main
from eval.serving.ranking.server_calibration import calibrate_server
from eval.serving.ranking.simulator import CostModel

TRUE = CostModel(base=0.020, prefill_token=0.0002, decode_token=0.004)
OVERHEAD = 0.030  # per request, outside the engine: must not leak into `base`


class FakeEngine:
    """Continuous batching with known step times: each step prefills every newly arrived request (its first
    token) and decodes one token of every other running one, taking ``TRUE.iteration(prefill, decode)``."""

    def __init__(self, max_seqs: int, serial_first: int = 0):
        self.max_seqs = max_seqs
        self.serial_first = serial_first  # the first this many requests run one at a time (a late client)
        self.taken = 0
        self.arrivals: queue.Queue = queue.Queue()
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self) -> None:
        running: list[dict] = []
        while True:
            new = [] if running else [self.arrivals.get()]  # idle: wait for one
            cap = 1 if self.taken + len(new) <= self.serial_first else self.max_seqs
            while len(running) + len(new) < cap and not self.arrivals.empty():
                new.append(self.arrivals.get())
            self.taken += len(new)
            time.sleep(TRUE.iteration(sum(r["prompt"] for r in new), len(running)))
            running += new
            for r in running:
                r["done"] += 1
                r["events"].put(r["done"])
            running = [r for r in running if r["done"] < r["max_tokens"]]


def handler(engine: FakeEngine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.reply(b'{"object": "list", "data": [{"id": "fake-model", "object": "model"}]}')

        def reply(self, payload: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["model"] == "fake-model" and body["ignore_eos"] and body["stream"]
            assert body["stream_options"]["continuous_usage_stats"]
            time.sleep(OVERHEAD)
            request = {"prompt": len(body["prompt"]), "max_tokens": body["max_tokens"], "done": 0}
            request["events"] = queue.Queue()
            engine.arrivals.put(request)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            done = 0
            while done < body["max_tokens"]:
                done = request["events"].get()
                usage = {"prompt_tokens": request["prompt"], "completion_tokens": done}
                self.event({"choices": [{"index": 0, "text": "x", "finish_reason": None}], "usage": usage})
            self.event({"choices": [], "usage": usage})
            self.chunk(b"data: [DONE]\n\n")
            self.chunk(b"")

        def event(self, payload: dict) -> None:
            self.chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

        def chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    return Handler


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # as uvicorn's backlog: 5 would drop connects of a batch, retried 1 s later


@pytest.fixture()
def fake_vllm(request):
    server = FakeServer(("127.0.0.1", 0), handler(FakeEngine(*getattr(request, "param", (64,)))))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_recovers_known_step_times(fake_vllm, tmp_path, capsys):
    out = tmp_path / "cost.json"
    argv = ["calibrate", "--server", fake_vllm, "--out", str(out), "--batches", "1,4,8", "--repeats", "2"]
    assert main([*argv, "--prompt-lens", "64,512,1024", "--decode-tokens", "12"]) == 0
    fitted = json.loads(out.read_text())
    assert fitted["model"] == "fake-model" and fitted["source"] == "vllm-server"
    # sleeps overshoot on a loaded machine: a little more per step, never less
    assert TRUE.base * 0.9 < fitted["base"] < TRUE.base * 1.3
    assert TRUE.decode_token * 0.85 < fitted["decode_token"] < TRUE.decode_token * 1.2
    assert TRUE.prefill_token * 0.85 < fitted["prefill_token"] < TRUE.prefill_token * 1.2
    assert OVERHEAD * 0.7 < fitted["request_overhead_s"] < OVERHEAD * 1.5
    assert len(fitted["decode_steps"]) == 6 and len(fitted["first_token_times"]) == 6
    loaded = CostModel.load(out)  # the simulator reads it as it is
    assert loaded.iteration(512, 8) == pytest.approx(
        fitted["base"] + 512 * fitted["prefill_token"] + 8 * fitted["decode_token"]
    )
    assert json.loads(capsys.readouterr().out)["base"] == fitted["base"]


@pytest.mark.parametrize("fake_vllm", [(2,)], indirect=True)
def test_refuses_a_batch_the_server_cannot_run_at_once(fake_vllm):
    with pytest.raises(ValueError, match="did not run 4 requests at once in 3 tries"):
        calibrate_server(fake_vllm, batches=(1, 4), prompt_lens=(8, 16), decode_tokens=6, repeats=1)


@pytest.mark.parametrize("fake_vllm", [(64, 5)], indirect=True)
def test_a_batch_that_did_not_overlap_once_is_sent_again(fake_vllm):
    """The batch-1 request and the first send of the batch of 4 run one after another (as when a busy client
    sends one request of the batch late); the second send overlaps and is measured."""
    fitted = calibrate_server(fake_vllm, batches=(1, 4), prompt_lens=(8, 16), decode_tokens=6, repeats=1)
    assert [s["batch"] for s in fitted["decode_steps"]] == [1, 4]
    assert TRUE.decode_token * 0.85 < fitted["decode_token"] < TRUE.decode_token * 1.5


def test_bad_input_is_one_line_before_any_request(tmp_path, capsys):
    out = str(tmp_path / "cost.json")
    for argv, message in [
        (["calibrate", "--out", out], "either MODEL or a --server"),
        (["calibrate", "--server", "ftp://127.0.0.1:1", "--out", out], "not an http:// URL"),
        (["calibrate", "--server", "http://127.0.0.1:9", "--out", out, "--batches", "4,4"], "two distinct"),
        (["calibrate", "--server", "http://127.0.0.1:9", "--out", out], "unreachable"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "to resolve" in err and err.count("\n") == 1
    assert not (tmp_path / "cost.json").exists()
