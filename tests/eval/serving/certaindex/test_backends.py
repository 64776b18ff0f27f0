"""Certaindex engines on a tiny random Llama: KV-cache reuse for probes, the loopback HTTP path, the CLI.

The tokenizer is character level over printable ASCII, so text survives the HTTP round trip exactly (a
token-for-token comparison of the two backends needs decode(encode(text)) == text).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eval.serving.certaindex.answers import PROBE_SUFFIX
from eval.serving.certaindex.backends import Sampling
from eval.serving.certaindex.cli import main
from eval.serving.certaindex.cot import run_cot
from eval.serving.certaindex.hf_backend import HFBackend
from eval.serving.certaindex.http_backend import OpenAIBackend
from eval.serving.certaindex.sc import replay, run_sc
from eval.serving.certaindex.server import make_server

GREEDY = Sampling(temperature=0.0)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Adds a BOS by default (like Llama's), and its chat template writes one too (like Llama-3's)."""
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(chars)} | {"<eos>": len(chars), "<bos>": len(chars) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    tok = char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    # never sample end-of-sequence (chains run their whole budget) or BOS (text round-trips exactly)
    bias = torch.zeros(len(tok))
    bias[[tok.eos_token_id, tok.bos_token_id]] = -1e4
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return HFBackend(model, tok)


@pytest.fixture(scope="module")
def server_url(backend):
    server = make_server(backend, "tiny", "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def scratch_probe(backend: HFBackend, ids: torch.Tensor, max_tokens: int) -> str:
    """The probe answer computed with a fresh cache over the whole text."""
    cache = DynamicCache(config=backend.model.config)
    new = backend.generate(torch.cat([ids, backend.encode(PROBE_SUFFIX)], dim=1), cache, max_tokens, GREEDY)
    return backend.decode(new[0])


def test_probe_reuses_cache_and_leaves_it_intact(backend):
    session = backend.session("What is 2+3? ")
    first = session.extend(12, Sampling(temperature=1.0, seed=1))
    assert first.input_tokens == session.prompt_len and first.tokens == 12
    cached = session.cache.get_seq_length()
    assert cached == session.ids.shape[1] - 1
    keys = [layer.keys.clone() for layer in session.cache.layers]
    probe = session.probe(PROBE_SUFFIX, 8, GREEDY)
    assert probe.input_tokens == 1 + len(backend.encode(PROBE_SUFFIX)[0])  # only the new tokens are forwarded
    assert probe.text == scratch_probe(backend, session.ids, 8)
    assert session.cache.get_seq_length() == cached
    assert all(torch.equal(k, layer.keys) for k, layer in zip(keys, session.cache.layers, strict=True))
    assert session.extend(5, GREEDY).input_tokens == 1


def test_probes_do_not_change_the_sampled_chain(backend):
    """An early-exit chain is a prefix of the full-budget chain with the same seed (probes sample too)."""
    kwargs = dict(max_tokens=48, chunk=8, sampling=Sampling(temperature=1.0, seed=3))
    full = run_cot(backend, "Q: 1+1? ", early_exit=False, **kwargs)
    probed = run_cot(
        backend, "Q: 1+1? ", early_exit=True, window=100, **kwargs
    )  # probes every chunk, never exits
    assert probed.text == full.text and probed.main_tokens == full.main_tokens == 48
    assert len(probed.probe_answers) == 5 and probed.probe_tokens > 0 and full.probe_tokens == 0


def test_batched_samples_share_prompt_cache(backend):
    samples = backend.sample("Say something: ", 3, 10, GREEDY)
    alone = backend.session("Say something: ").extend(10, GREEDY)
    assert [s.text for s in samples] == [alone.text] * 3 and [s.tokens for s in samples] == [10] * 3
    assert sum(s.input_tokens for s in samples) == alone.input_tokens + 2
    drawn = backend.sample("Say something: ", 4, 10, Sampling(temperature=1.0, seed=0))
    assert len({s.text for s in drawn}) > 1  # sampled rows differ


def test_http_backend_matches_transformers(backend, server_url):
    client = OpenAIBackend(server_url)
    assert client.model == "tiny"
    one = client.complete("Hello ", 9, GREEDY)
    local = backend.session("Hello ").extend(9, GREEDY)
    assert (one.text, one.tokens, one.finished) == (local.text, local.tokens, local.finished)
    kwargs = dict(
        max_tokens=24, chunk=6, window=2, sampling=GREEDY, probe_sampling=GREEDY, probe_max_tokens=6
    )
    remote, here = run_cot(client, "Q: 3*4? ", **kwargs), run_cot(backend, "Q: 3*4? ", **kwargs)
    assert remote.probe_input_tokens > here.probe_input_tokens  # the toy server re-reads the whole text
    assert {**remote.to_dict(), "probe_input_tokens": 0} == {**here.to_dict(), "probe_input_tokens": 0}
    assert here.probe_answers and here.main_tokens >= 12
    draws = client.sample("Q: ", 3, 5, Sampling(temperature=1.0, seed=7))
    assert len(draws) == 3 and all(d.tokens == 5 for d in draws)


def test_http_prompt_text_gets_no_second_bos(backend, server_url):
    """The server tokenizes as vLLM does (add_special_tokens defaults to true); chat text already has its BOS."""
    prompt = backend.chat_format("What is 2+3?")
    assert prompt.startswith("<bos>") and backend.tokenizer(prompt).input_ids[:2] == [97, 97]
    client = OpenAIBackend(server_url)
    reply = client.complete(prompt, 7, GREEDY)
    local = backend.session(prompt).extend(7, GREEDY)
    assert reply.input_tokens == backend.encode(prompt).shape[1] == local.input_tokens
    assert reply.text == local.text


class PairingScriptedServer:
    """An OpenAI-compatible stub that answers a probe only once the chunk generated beside it has arrived, and
    that chunk only once its probe has: a client that sent them one after the other would never get either
    answer (the pair's barrier breaks after ``timeout`` s and the test fails).  Probe k reads the text after
    chunk k, the same prompt as chunk k + 1 without the probe suffix; the first chunk has no probe beside it."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.log, self.lock, self.pairs = [], threading.Lock(), {}
        outer = self

        def barrier(prompt: str) -> threading.Barrier:
            with outer.lock:
                return outer.pairs.setdefault(prompt, threading.Barrier(2, timeout=timeout))

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._reply({"data": [{"id": "stub"}]})

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                probe = req["prompt"].endswith(PROBE_SUFFIX)
                text = req["prompt"].removesuffix(PROBE_SUFFIX)
                paired = None  # the first chunk waits for nothing
                if probe or text != "Q:":
                    try:
                        barrier(text).wait()
                        paired = True
                    except threading.BrokenBarrierError:
                        paired = False
                with outer.lock:
                    outer.log.append((probe, req["prompt"], paired))
                reply = "5} \\]" if probe else "step "
                self._reply({
                    "choices": [{"text": reply, "finish_reason": "stop" if probe else "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 3 if probe else req["max_tokens"]},
                })  # fmt: skip

            def log_message(self, format: str, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


def test_http_probes_run_beside_the_next_chunk():
    stub = PairingScriptedServer()
    try:
        result = run_cot(OpenAIBackend(stub.url), "Q:", max_tokens=40, chunk=8, window=100)
    finally:
        stub.server.shutdown()
        stub.server.server_close()
    chunks = [r for r in stub.log if not r[0]]
    probes = sorted(r[1] for r in stub.log if r[0])
    assert len(chunks) == 5 and result.main_tokens == 40
    # probe k is the text after chunk k (not a later one), and was in flight together with chunk k + 1
    assert probes == ["Q:" + "step " * k + PROBE_SUFFIX for k in range(1, 5)]
    assert len(stub.log) == 9 and [r[2] for r in stub.log].count(True) == 8, stub.log


def test_http_errors_are_one_line(server_url):
    with pytest.raises(RuntimeError, match="HTTP 400: .*n must be 1"):
        OpenAIBackend(server_url)._request("POST", "/completions", {"prompt": "x", "n": 2})
    with pytest.raises(ConnectionError, match="to resolve, start the server"):
        OpenAIBackend("http://127.0.0.1:9/v1", model="m").complete("x", 1, GREEDY)


def test_adaptive_sc_is_prefix_of_full_budget(backend):
    kwargs = dict(max_samples=6, step=2, max_tokens=6, sampling=Sampling(temperature=1.0, seed=11))
    full = run_sc(backend, "Count: ", threshold=None, **kwargs)
    adaptive = run_sc(
        backend, "Count: ", threshold=0.0, **kwargs
    )  # certaindex >= 0 always: stop after one round
    assert len(full.answers) == 6 and len(adaptive.answers) == 2 and adaptive.stopped_early
    assert adaptive.answers == full.answers[:2] and adaptive.sample_tokens == full.sample_tokens[:2]
    assert replay(full, 2, 0.0).to_dict() == adaptive.to_dict()


def test_cli_resumes_and_refuses_mixed_options(backend, tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    backend.model.save_pretrained(model_dir)
    backend.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "cot.jsonl"
    args = ["cot", str(model_dir), "--data", "arith:3:0", "--max-tokens", "8", "--chunk", "4",
            "--out", str(out)]  # fmt: skip
    main(args[:-1] + [str(tmp_path / "ref.jsonl")])
    ref = [json.loads(x) for x in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert [r["id"] for r in ref] == ["arith-0-0", "arith-0-1", "arith-0-2"] and all(
        r["main_tokens"] <= 16 for r in ref
    )
    summary = json.loads((tmp_path / "ref.jsonl.summary.json").read_text())
    assert summary["problems"] == 3
    assert summary["mean_probe_tokens"] == pytest.approx(sum(r["probe_tokens"] for r in ref) / 3)
    assert summary["early_exit_rate"] == sum(r["exited_early"] for r in ref) / 3
    # an interrupted run: header + the first record already on disk; the rerun solves only the other two
    partial = out.with_name(out.name + ".partial")
    options = {**summary["options"], "out": str(out)}
    partial.write_text(
        json.dumps({"options": options}) + "\n" + json.dumps({**ref[0], "main_tokens": -1}) + "\n"
    )
    main(args)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["main_tokens"] for r in records] == [-1, ref[1]["main_tokens"], ref[2]["main_tokens"]]
    assert not partial.exists()
    capsys.readouterr()
    assert main(args) == 2
    assert "exists; to resolve" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.with_name("other.jsonl.partial").write_text(json.dumps({"options": {"seed": 1}}) + "\n")
    assert main([*args[:-1], str(other)]) == 2
    assert "other options; to resolve" in capsys.readouterr().err


@pytest.mark.smollm2
def test_smollm2_probe_with_cache_equals_fresh_probe(smollm2):
    real = HFBackend.from_pretrained(str(smollm2))
    session = real.session(real.chat_format("Tom has 3 apples and gets 4 more. How many apples now?"))
    session.extend(24, GREEDY)
    probe = session.probe(PROBE_SUFFIX, 12, GREEDY)
    assert probe.text == scratch_probe(real, session.ids, 12)
    assert probe.input_tokens == 1 + len(real.encode(PROBE_SUFFIX)[0])


def test_cli_calibrate_picks_cheapest_feasible_threshold(backend, tmp_path):
    model_dir = tmp_path / "tiny"
    backend.model.save_pretrained(model_dir)
    backend.tokenizer.save_pretrained(model_dir)
    out = tmp_path / "dev.jsonl"
    main(["calibrate", str(model_dir), "--data", "arith:3:0", "--max-samples", "4", "--step", "2",
          "--max-tokens", "6", "--temperature", "1.0", "--out", str(out)])  # fmt: skip
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["samples"] for r in records] == [4, 4, 4]  # the dev pass always draws the full budget
    summary = json.loads(out.with_name("dev.jsonl.summary.json").read_text())
    full, *grid = summary["points"]
    assert full["threshold"] is None and len(grid) == 21
    assert full["mean_tokens"] == sum(r["tokens"] for r in records) / 3
    feasible = [p for p in summary["points"] if p["accuracy"] >= full["accuracy"] - 0.01]
    assert summary["chosen"] in feasible
    assert summary["chosen"]["mean_tokens"] == min(p["mean_tokens"] for p in feasible)
