"""The simulator's cost model measured on a running vLLM server, from outside, through its OpenAI API.

The simulator charges ``base + prefill_token * prefill tokens + decode_token * decoding sequences`` seconds
per engine step (:class:`.simulator.CostModel`).  A server reports no step times, but its token streams show
them, so this times requests of controlled shape (prompts of random token ids, which no prefix cache holds;
``ignore_eos`` so every reply has its requested length; ``stream_options.continuous_usage_stats`` so each
event says how many tokens the reply has reached, even when the server merges steps into one event):

* **decode**: ``b`` streamed requests sent at once with a short prompt decode in lockstep, one token per step
  each.  Between the last first token and the first last token every step holds exactly ``b`` decoding
  sequences, so the median time per token there is one such step: ``base + decode_token * b``.  A fit over
  several ``b`` gives both terms.  If the server runs fewer than ``b`` at once (``--max-num-seqs``, a KV
  cache too small), a stream starts only after another ended, and the measurement is refused.
* **prefill**: one request alone with ``P`` prompt tokens and one output token; its time to first token is one
  step with ``P`` prefill tokens plus what the request costs outside the engine (HTTP, input
  processing, detokenizing, the hop between the server's processes): ``overhead + base + prefill_token * P``.
  The slope over several ``P`` is ``prefill_token``; the intercept minus the decode fit's ``base`` is the
  overhead, reported beside the model but not in it (the simulator times engine steps; a measured latency of
  seconds carries it once per request).  ``P`` must stay within the server's ``--max-num-batched-tokens``,
  else the prompt is prefilled in several steps.

Server responses are untrusted data: lines are read with a length cap, parsed as JSON only, and any field that
is missing or of the wrong type stops the calibration with a one-line error naming the request.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass

import numpy as np

from .simulator import CostModel

MAX_LINE = 1 << 20  # bytes of one response line (an SSE event); longer is not a server we understand
MAX_BODY = 1 << 20
TOKEN_RANGE = (100, 1100)  # ordinary token ids in every vocabulary of interest (specials sit below 100)
DECODE_PROMPT_TOKENS = 16
OVERLAP_TRIES = 3  # sends of one decode batch before its streams' not overlapping is the server's doing


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: host, port, path prefix and the model name requests carry."""

    host: str
    port: int
    base: str
    model: str = ""

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(
                f"server {url!r} is not an http:// URL; to resolve, pass e.g. http://127.0.0.1:8000"
            )
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/"))

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)


@dataclass
class Stream:
    """One streamed completion: when it was sent and, per event, the arrival time and tokens reached."""

    sent: float
    times: list[float]
    tokens: list[int]

    @property
    def first_token(self) -> float:
        return self.times[0]

    @property
    def last_token(self) -> float:
        return self.times[-1]


def served_model(endpoint: Endpoint, timeout: float = 30) -> str:
    """The only model ``/v1/models`` lists (with several, the caller must name one)."""
    conn = endpoint.connection(timeout)
    try:
        conn.request("GET", endpoint.base + "/v1/models")
        response = conn.getresponse()
        raw = response.read(MAX_BODY + 1)
    except OSError as err:
        raise ValueError(
            f"server http://{endpoint.host}:{endpoint.port} unreachable ({type(err).__name__}: {err}); "
            "to resolve, start it or fix --server"
        ) from None
    finally:
        conn.close()
    try:
        if response.status != 200 or len(raw) > MAX_BODY:
            raise ValueError
        ids = [m["id"] for m in json.loads(raw)["data"]]
        if not all(isinstance(i, str) for i in ids):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"GET /v1/models answered {response.status} without a model list; "
            "to resolve, point --server at an OpenAI-compatible server"
        ) from None
    if len(ids) != 1:
        raise ValueError(f"the server serves {ids}; to resolve, name one with --served-model")
    return ids[0]


def stream_completion(endpoint: Endpoint, prompt: list[int], max_tokens: int, timeout: float) -> Stream:
    """Send one streamed ``/v1/completions`` request of token ids; time every event that carries tokens."""
    body = {
        "model": endpoint.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    what = f"a completion of {len(prompt)} prompt tokens"
    conn = endpoint.connection(timeout)
    times: list[float] = []
    tokens: list[int] = []
    try:
        sent = time.perf_counter()
        conn.request(
            "POST", endpoint.base + "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            raise ValueError(
                f"{what} answered {response.status}: {response.read(300)!r}; to resolve, check the server "
                "(a vLLM server: token-id prompts, ignore_eos and stream_options are its API)"
            )
        while line := response.readline(MAX_LINE):
            arrived = time.perf_counter()
            if not line.endswith(b"\n"):
                raise ValueError(f"{what}: an event line over {MAX_LINE} bytes; to resolve, check the server")
            payload = line.strip().removeprefix(b"data:").strip()
            if not line.startswith(b"data:") or payload == b"[DONE]":
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                raise ValueError(f"{what}: an event that is not JSON; to resolve, check the server") from None
            if not isinstance(event, dict) or not event.get("choices"):
                continue  # the final usage-only event
            usage = event.get("usage")
            reached = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if type(reached) is not int:
                raise ValueError(
                    f"{what}: an event without usage.completion_tokens; to resolve, use a server that "
                    "honours stream_options.continuous_usage_stats (vLLM does)"
                )
            if not tokens or reached > tokens[-1]:
                times.append(arrived)
                tokens.append(reached)
    except OSError as err:
        raise ValueError(
            f"{what} failed ({type(err).__name__}: {err}); to resolve, check the server"
        ) from None
    finally:
        conn.close()
    if not tokens or tokens[-1] != max_tokens:
        raise ValueError(
            f"{what} produced {tokens[-1] if tokens else 0} of {max_tokens} tokens; to resolve, use a server "
            "that honours ignore_eos (vLLM does)"
        )
    return Stream(sent, times, tokens)


def concurrent_streams(
    endpoint: Endpoint, batch: int, decode_tokens: int, rng: np.random.Generator, timeout: float
) -> list[Stream]:
    """``batch`` streamed completions of random prompts, sent together from one thread each."""
    prompts = [rng.integers(*TOKEN_RANGE, DECODE_PROMPT_TOKENS).tolist() for _ in range(batch)]
    streams: list[Stream | BaseException] = [ValueError("not run")] * batch
    barrier = threading.Barrier(batch)

    def run(i: int) -> None:
        try:
            barrier.wait()
            streams[i] = stream_completion(endpoint, prompts[i], decode_tokens, timeout)
        except BaseException as err:  # re-raised below, in the caller's thread
            streams[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in streams:
        if isinstance(s, BaseException):
            raise s
    return streams  # type: ignore[return-value]


def decode_step(endpoint: Endpoint, batch: int, decode_tokens: int, rng: np.random.Generator, timeout: float):
    """Seconds of one step with ``batch`` decoding sequences: ``batch`` streams at once, lockstep window.

    A busy client can send one request of the batch after another has finished, so a batch whose streams did
    not overlap is sent again, ``OVERLAP_TRIES`` times in all, before the server is blamed."""
    for _ in range(OVERLAP_TRIES):
        done = concurrent_streams(endpoint, batch, decode_tokens, rng, timeout)
        start, end = max(s.first_token for s in done), min(s.last_token for s in done)
        if start < end:
            break
    else:
        raise ValueError(
            f"the server did not run {batch} requests at once in {OVERLAP_TRIES} tries (one started after "
            "another ended); to resolve, pass --batches up to its --max-num-seqs and within its KV cache"
        )
    gaps = []  # seconds per token between consecutive events inside the window, once per token
    for s in done:
        for i in range(1, len(s.times)):
            if start <= s.times[i - 1] and s.times[i] <= end:
                steps = s.tokens[i] - s.tokens[i - 1]
                gaps += [(s.times[i] - s.times[i - 1]) / steps] * steps
    if len(gaps) < 3:
        raise ValueError(
            f"only {len(gaps)} steps with all {batch} requests decoding; to resolve, raise --decode-tokens"
        )
    return float(np.median(gaps))


def first_token_time(
    endpoint: Endpoint, prompt_tokens: int, rng: np.random.Generator, timeout: float
) -> float:
    """Seconds from sending one request of ``prompt_tokens`` tokens alone to its first token."""
    stream = stream_completion(endpoint, rng.integers(*TOKEN_RANGE, prompt_tokens).tolist(), 1, timeout)
    return stream.first_token - stream.sent


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    (intercept, slope), *_ = np.linalg.lstsq(np.c_[np.ones(len(x)), x], np.asarray(y), rcond=None)
    return float(intercept), float(slope)


def calibrate_server(
    url: str,
    model: str | None = None,
    batches: tuple[int, ...] = (1, 4, 8, 16),
    prompt_lens: tuple[int, ...] = (64, 256, 512, 1024),
    decode_tokens: int = 48,
    repeats: int = 3,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict:
    """Measure the server's step times and fit :class:`CostModel` to them; the cost-model JSON's contents.

    Every shape is measured ``repeats`` times, interleaved (all shapes once, then again), so a slow spell
    of a shared machine spreads over all of them; the fits use every measurement."""
    if len(set(batches)) < 2 or len(set(prompt_lens)) < 2 or min(*batches, *prompt_lens) < 1:
        raise ValueError(
            f"batches {batches} and prompt lengths {prompt_lens} need two distinct positive values each to fit "
            "a line; to resolve, pass e.g. --batches 1,4,8,16 --prompt-lens 64,256,512,1024"
        )
    if decode_tokens < 4 or repeats < 1:
        raise ValueError(f"decode_tokens={decode_tokens}, repeats={repeats}; to resolve, pass >= 4 and >= 1")
    endpoint = Endpoint.parse(url)
    endpoint = Endpoint(endpoint.host, endpoint.port, endpoint.base, model or served_model(endpoint))
    rng = np.random.default_rng(seed)
    first_token_time(endpoint, max(prompt_lens), rng, timeout)  # warm-up, not kept
    decode: list[tuple[int, float]] = []
    prefill: list[tuple[int, float]] = []
    for _ in range(repeats):
        decode += [(b, decode_step(endpoint, b, decode_tokens, rng, timeout)) for b in batches]
        prefill += [(p, first_token_time(endpoint, p, rng, timeout)) for p in prompt_lens]
    base, decode_token = _line([b for b, _ in decode], [s for _, s in decode])
    intercept, prefill_token = _line([p for p, _ in prefill], [s for _, s in prefill])
    cost = CostModel(max(base, 0.0), max(prefill_token, 0.0), max(decode_token, 0.0))
    return {
        **asdict(cost),
        "source": "vllm-server",
        "server": url,
        "model": endpoint.model,
        "request_overhead_s": intercept - base,
        "decode_steps": [{"batch": b, "step_s": s} for b, s in decode],
        "first_token_times": [{"prompt_tokens": p, "ttft_s": s} for p, s in prefill],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
