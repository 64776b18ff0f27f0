"""transformers engine for Certaindex: one ``DynamicCache`` per session, shared by the main chain and probes.

``generate`` given token ids and a cache that already holds a prefix of them forwards only the uncached
tail, and leaves every token but the last sampled one in the cache.  So a chunk costs its own tokens, and a
probe forwards only the last main token, the probe suffix and its own answer: it runs on the session's cache
and then crops the cache back (``DynamicCache.crop`` with a negative count), or on a deep copy when some
layer cannot be cropped exactly (sliding-window or linear-attention layers).  Self-consistency samples
prefill the prompt once and repeat that cache across the batch.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from .backends import Completion, Sampling, render_chat


class HFBackend:
    """A causal LM and its tokenizer; sessions and samples are batch-1 prompts."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32") -> HFBackend:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        return cls(model, AutoTokenizer.from_pretrained(path))

    def chat_format(self, question: str) -> str:
        return render_chat(self.tokenizer, question)

    def encode(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        return ids.to(self.model.device)

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.inference_mode()
    def generate(
        self, ids: torch.Tensor, cache: DynamicCache, max_tokens: int, sampling: Sampling
    ) -> torch.Tensor:
        """Continue ``ids`` (cache holds a prefix of them) by up to ``max_tokens``; return only new ids."""
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=sampling.temperature > 0,
            temperature=sampling.temperature if sampling.temperature > 0 else None,
            top_p=sampling.top_p if sampling.temperature > 0 else None,
            top_k=None,
            eos_token_id=sorted(self.eos_ids) or None,
            pad_token_id=min(self.eos_ids) if self.eos_ids else 0,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sampling.seed)
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config, cache=cache
            )
        return out[:, ids.shape[1] :]

    def count(self, new_ids: torch.Tensor) -> tuple[int, bool]:
        """Generated tokens up to and including the first end-of-sequence token, and whether one was hit."""
        row = new_ids.tolist()
        for i, token in enumerate(row):
            if token in self.eos_ids:
                return i + 1, True
        return len(row), False

    def session(self, prompt: str) -> HFSession:
        return HFSession(self, prompt)

    @torch.inference_mode()
    def sample(self, prompt: str, n: int, max_tokens: int, sampling: Sampling) -> list[Completion]:
        ids = self.encode(prompt)
        cache = DynamicCache(config=self.model.config)
        if ids.shape[1] > 1:
            self.model(ids[:, :-1], cache=cache)  # prefill once, then share across the n samples
        cache.batch_repeat_interleave(n)
        new = self.generate(ids.repeat(n, 1), cache, max_tokens, sampling)
        results = []
        for i, row in enumerate(new):
            tokens, finished = self.count(row)
            results.append(
                Completion(self.decode(row[:tokens]), tokens, ids.shape[1] if i == 0 else 1, finished)
            )
        return results


class HFSession:
    """Token ids of prompt + chain so far and the KV cache of all but the last of them."""

    def __init__(self, backend: HFBackend, prompt: str) -> None:
        self.backend = backend
        self.ids = backend.encode(prompt)
        self.prompt_len = self.ids.shape[1]
        self.cache = DynamicCache(config=backend.model.config)
        self.finished = False

    @property
    def text(self) -> str:
        return self.backend.decode(self.ids[0, self.prompt_len :])

    def extend(self, max_tokens: int, sampling: Sampling) -> Completion:
        if self.finished:
            raise RuntimeError(
                "session already ended with an end-of-sequence token; to resolve, start a new session"
            )
        cached = self.cache.get_seq_length()
        new = self.backend.generate(self.ids, self.cache, max_tokens, sampling)
        tokens, self.finished = self.backend.count(new[0])
        self.ids = torch.cat([self.ids, new[:, :tokens]], dim=1)
        return Completion(
            self.backend.decode(new[0, :tokens]), tokens, self.ids.shape[1] - tokens - cached, self.finished
        )

    def start_probe(self, suffix: str, max_tokens: int, sampling: Sampling) -> Future[Completion]:
        """The probe, run to completion now: it needs the session's cache, which the next chunk extends."""
        done: Future[Completion] = Future()
        done.set_result(self.probe(suffix, max_tokens, sampling))
        return done

    def probe(self, suffix: str, max_tokens: int, sampling: Sampling) -> Completion:
        ids = torch.cat([self.ids, self.backend.encode(suffix)], dim=1)
        cached = self.cache.get_seq_length()
        croppable = all(type(layer) is DynamicLayer for layer in self.cache.layers)
        cache = self.cache if croppable else copy.deepcopy(self.cache)
        try:
            new = self.backend.generate(ids, cache, max_tokens, sampling)
        finally:
            if croppable:
                self.cache.crop(cached - self.cache.get_seq_length())
        tokens, finished = self.backend.count(new[0])
        return Completion(self.backend.decode(new[0, :tokens]), tokens, ids.shape[1] - cached, finished)
