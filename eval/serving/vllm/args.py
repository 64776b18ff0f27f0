"""The vLLM serve command for a checkpoint and the serving artifacts built for it.

``swiftkv vllm-args CHECKPOINT [--suffix-cache DIR] [--ranker DIR] [--cpu]`` prints one shell command.
Everything is checked before anything is printed, so a command that prints is one that will load:

* the checkpoint must be a Hugging Face folder vLLM can serve; a SwiftKV checkpoint needs no extra flag
  (our ``vllm.general_plugins`` entry point registers it and turns on fast prefill), only this
  distribution installed next to vLLM;
* a suffix cache adds ``--speculative-config`` with its settings (vLLM's ``suffix`` method, which needs
  ``arctic-inference``; vLLM cannot preload the built tree, so it starts empty and fills as it serves);
  the cache must have been built with this checkpoint's tokenizer;
* a ranking predictor adds ``--scheduling-policy priority``: the client scores each prompt with
  ``eval.serving.ranking.predictors.Ranker`` and sends ``priority = -round(score * 1000)`` (vLLM serves lower
  priority values first; our scores are higher for shorter outputs);
* ``--cpu`` adds what vLLM's CPU backend needs (ENVIRONMENT.md): eager mode, an explicit KV-cache size and
  both cores.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from swiftkv.convert import read_config

SERVER = ("python", "-m", "vllm.entrypoints.openai.api_server")
PRIORITY_SCALE = 1000  # vLLM priorities are integers; scores are floats of order 1


@dataclass
class ServeCommand:
    """Environment, argv and explanatory notes of one ``vllm`` server invocation."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """The notes as ``#`` comments, then the command with its environment, ready to paste."""
        env = [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        return "\n".join([*(f"# {note}" for note in self.notes), " ".join([*env, shlex.join(self.argv)])])


def _tokenizer_fingerprint(checkpoint: Path) -> str:
    from transformers import AutoTokenizer

    from ..suffix.artifact import tokenizer_fingerprint

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(checkpoint))


def _suffix_args(cache: Path, checkpoint: Path) -> tuple[list[str], str]:
    from ..suffix.artifact import read_meta, vllm_speculative_config
    from ..suffix.cache import SpecConfig

    meta = read_meta(cache)
    if meta["tokenizer"]["fingerprint"] != _tokenizer_fingerprint(checkpoint):
        raise ValueError(
            f"suffix cache {cache} was built with tokenizer {meta['tokenizer']['name_or_path']!r}, not "
            f"{checkpoint}'s; to resolve, rebuild it with `swiftkv suffix build {checkpoint} --out CACHE`"
        )
    spec = json.dumps(vllm_speculative_config(SpecConfig(**meta["config"])), separators=(",", ":"))
    note = (
        f"suffix decoding with the settings of {cache} (needs `pip install arctic-inference`); "
        "vLLM starts with an empty tree and fills it with the responses it serves"
    )
    return ["--speculative-config", spec], note


def _ranker_args(ranker: Path, checkpoint: Path, config: dict) -> tuple[list[str], str]:
    from ..ranking.predictors import check_target, load_spec

    spec = load_spec(ranker)
    if spec.kind == "swiftkv-head":
        hidden = config.get("hidden_size")
        if spec.feature_dim != 2 * (hidden or 0):  # pooled [mean over the prompt, last token] of x_l
            raise ValueError(
                f"ranker {ranker} reads pooled hidden states of size {spec.feature_dim} (2 x hidden size), but "
                f"{checkpoint} has hidden_size {hidden}; to resolve, train the ranker on this model"
            )
        check_target(spec, ranker, checkpoint)
    target = f", target_model={str(checkpoint)!r}" if spec.kind == "swiftkv-head" else ""
    note = (
        f"learning-to-rank scheduling: score each prompt with "
        f"eval.serving.ranking.predictors.Ranker({str(ranker)!r}{target}) "
        f"and send priority = -round(score * {PRIORITY_SCALE}) with the request (lower is served first)"
    )
    return ["--scheduling-policy", "priority"], note


def serve_command(
    checkpoint: str | os.PathLike,
    suffix_cache: str | os.PathLike | None = None,
    ranker: str | os.PathLike | None = None,
    cpu: bool = False,
    port: int = 8000,
    kv_cache_gib: int = 1,
) -> ServeCommand:
    """Check the checkpoint and artifacts and build the command that serves them; raise ``ValueError`` /
    ``FileNotFoundError`` with a one-line reason otherwise."""
    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)  # one-line errors (a ValueError) for a missing or corrupt config
    if not config.get("architectures"):
        raise ValueError(
            f"checkpoint {checkpoint}/config.json names no architectures; vLLM cannot pick a model class"
        )
    command = ServeCommand(argv=[*SERVER, "--model", str(checkpoint), "--port", str(port)])
    if config.get("swiftkv"):
        command.notes.append(
            f"SwiftKV checkpoint ({config['num_key_value_layers']} of {config['num_hidden_layers']} layers run on "
            "prompt tokens): served by this distribution's vLLM plugin, loaded by entry point"
        )
    if suffix_cache is not None:
        args, note = _suffix_args(Path(suffix_cache), checkpoint)
        command.argv += args
        command.notes.append(note)
    if ranker is not None:
        args, note = _ranker_args(Path(ranker), checkpoint, config)
        command.argv += args
        command.notes.append(note)
    if cpu:
        command.argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_gib << 30)]
        command.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return command
