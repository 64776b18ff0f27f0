"""OpenAI-compatible completions client for Certaindex (vLLM, SGLang, ``swiftkv certaindex serve``).

A session is the prompt text plus the chain so far; each chunk and each probe is one ``/completions``
request on that text, so the server's prefix cache (vLLM's automatic prefix caching) plays the role the KV
cache plays in the transformers backend.  Prompts go with ``add_special_tokens: false``: they are rendered chat
text that already starts with the template's BOS, and vLLM would otherwise add a second one.  A probe is sent
while the next chunk is generated (``start_probe``: a thread pool), as the reference client does.  Self-consistency sends its n samples as n concurrent requests with
seeds seed..seed+n-1, so each sample's ``usage`` gives its own token count and the server can batch them.
Only the standard library is used (urllib), so no client package is needed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from .backends import Completion, Sampling, render_chat


class OpenAIBackend:
    """Client for ``{base_url}/completions``; ``model`` defaults to the first id from ``{base_url}/models``."""

    def __init__(
        self, base_url: str, model: str | None = None, tokenizer: str | None = None, timeout: float = 600
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.model = model or self._request("GET", "/models")["data"][0]["id"]
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="certaindex-probe")
        self.tokenizer = None
        if tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise RuntimeError(
                f"{method} {self.base_url + path} failed with HTTP {err.code}: {detail}"
            ) from err
        except urllib.error.URLError as err:
            raise ConnectionError(
                f"cannot reach {self.base_url + path} ({err.reason}); to resolve, start the server or fix --model"
            ) from err

    def complete(self, prompt: str, max_tokens: int, sampling: Sampling) -> Completion:
        reply = self._request(
            "POST",
            "/completions",
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "seed": sampling.seed,
                "add_special_tokens": False,  # the prompt is rendered chat text that holds its own BOS
            },
        )
        choice, usage = reply["choices"][0], reply.get("usage") or {}
        return Completion(
            choice["text"],
            int(usage.get("completion_tokens", 0)),
            int(usage.get("prompt_tokens", 0)),
            choice.get("finish_reason") not in (None, "length"),
        )

    def chat_format(self, question: str) -> str:
        return render_chat(self.tokenizer, question)

    def session(self, prompt: str) -> HTTPSession:
        return HTTPSession(self, prompt)

    def sample(self, prompt: str, n: int, max_tokens: int, sampling: Sampling) -> list[Completion]:
        seeds = [replace(sampling, seed=sampling.seed + i) for i in range(n)]
        with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
            return list(pool.map(lambda s: self.complete(prompt, max_tokens, s), seeds))


class HTTPSession:
    """Prompt text plus the chain generated so far."""

    def __init__(self, backend: OpenAIBackend, prompt: str) -> None:
        self.backend = backend
        self.prompt = prompt
        self.text = ""
        self.finished = False

    def extend(self, max_tokens: int, sampling: Sampling) -> Completion:
        if self.finished:
            raise RuntimeError("session already ended with a stop token; to resolve, start a new session")
        result = self.backend.complete(self.prompt + self.text, max_tokens, sampling)
        self.text += result.text
        self.finished = result.finished
        return result

    def start_probe(self, suffix: str, max_tokens: int, sampling: Sampling) -> Future[Completion]:
        """Send the probe on the text so far now; it stays in flight while the next chunk is generated."""
        text = self.prompt + self.text + suffix
        return self.backend.pool.submit(self.backend.complete, text, max_tokens, sampling)
