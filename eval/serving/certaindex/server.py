"""A minimal OpenAI-compatible completions server around the transformers backend.

For trying the HTTP path of Certaindex without vLLM (which needs CUDA or its own CPU build) and for the
loopback test of ``http_backend``.  It serves ``GET /v1/models`` and ``POST /v1/completions`` (string
prompt, ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``n`` = 1, ``add_special_tokens``) with
``usage`` token counts, one request at a time.  It tokenizes the prompt as vLLM does: with the tokenizer's
special tokens (a BOS for Llama-style tokenizers) unless the request says ``add_special_tokens: false``.  It binds to 127.0.0.1 unless told otherwise; it has no authentication.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from transformers import DynamicCache

from .backends import Sampling
from .hf_backend import HFBackend


def make_server(backend: HFBackend, name: str, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Bind a server (port 0 = any free port; read it from ``server.server_address``); call ``serve_forever``."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._reply(status, {"error": {"message": message, "type": "invalid_request_error"}})

        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/v1/models":
                return self._error(
                    404, f"no route {self.path}; this server has /v1/models and /v1/completions"
                )
            self._reply(200, {"object": "list", "data": [{"id": name, "object": "model"}]})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/completions":
                return self._error(
                    404, f"no route {self.path}; this server has /v1/models and /v1/completions"
                )
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompt, max_tokens = req["prompt"], int(req.get("max_tokens", 16))
                if not isinstance(prompt, str) or int(req.get("n", 1)) != 1 or max_tokens < 1:
                    raise ValueError("prompt must be one string, n must be 1, max_tokens must be >= 1")
                special = req.get("add_special_tokens", True)
                if not isinstance(special, bool):
                    raise ValueError("add_special_tokens must be true or false")
                sampling = Sampling(
                    float(req.get("temperature", 1.0)),
                    float(req.get("top_p", 1.0)),
                    int(req.get("seed") or 0),
                )
            except (KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
                return self._error(400, f"bad request: {err}")
            ids = backend.tokenizer(prompt, add_special_tokens=special, return_tensors="pt").input_ids
            with lock:
                new = backend.generate(
                    ids.to(backend.model.device),
                    DynamicCache(config=backend.model.config),
                    max_tokens,
                    sampling,
                )
            tokens, finished = backend.count(new[0])
            usage = {"prompt_tokens": ids.shape[1], "completion_tokens": tokens}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            choice = {
                "index": 0,
                "text": backend.decode(new[0, :tokens]),
                "finish_reason": "stop" if finished else "length",
            }
            self._reply(
                200,
                {
                    "id": f"cmpl-{time.time_ns()}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": name,
                    "choices": [choice],
                    "usage": usage,
                },
            )

        def log_message(self, format: str, *args) -> None:  # keep test and CLI output clean
            pass

    return ThreadingHTTPServer((host, port), Handler)
