"""``swiftkv vllm-args``: the printed serve command carries the artifacts' settings, vLLM's own parser
accepts it, and mismatched or missing artifacts are refused with one line before anything is printed."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_base
from test_suffix_artifact import filled_cache, word_tokenizer

import swiftkv.convert
from eval.serving.ranking.train import TrainConfig, train_ranker
from eval.serving.suffix.artifact import save_cache, vllm_speculative_config
from eval.serving.vllm.args import PRIORITY_SCALE, serve_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("vllm-args")
    tiny_base("llama").save_pretrained(tmp / "base")
    word_tokenizer().save_pretrained(tmp / "base")
    return swiftkv.convert.convert(tmp / "base", tmp / "swiftkv", swiftkv_fraction=0.5)


def trained_ranker(model_dir: Path, out: Path) -> Path:
    """A swiftkv-head ranker trained by the real training function on ``model_dir``'s x_l."""
    traces = out.with_name(out.name + "-traces")
    traces.mkdir()
    rows = [{"prompt": " ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(3 + i % 5)), "output_len": 5 + 9 * (i % 5)}
            for i in range(24)]  # fmt: skip
    (traces / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (traces / "meta.json").write_text(json.dumps({"model": str(model_dir), "max_new_tokens": 64}))
    config = TrainConfig(epochs=2, list_size=4, head_hidden=8, max_prompt_tokens=16, label_bin=4)
    return train_ranker(traces, out, config)


@pytest.fixture(scope="module")
def ranker(checkpoint, tmp_path_factory) -> Path:
    return trained_ranker(checkpoint.parent / "base", tmp_path_factory.mktemp("ranker") / "ranker")


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_swiftkv_checkpoint_with_suffix_cache_and_ranker(checkpoint, ranker, tmp_path):
    cache = filled_cache()
    save_cache(cache, tmp_path / "cache", word_tokenizer())
    config = json.loads((checkpoint / "config.json").read_text())
    spec = json.loads((ranker / "ranker.json").read_text())
    assert spec["feature_dim"] == 2 * config["hidden_size"]  # pooled [mean, last token] of x_l
    command = serve_command(checkpoint, tmp_path / "cache", ranker, cpu=True)
    argv = command.argv
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert option(argv, "--model") == str(checkpoint)
    assert json.loads(option(argv, "--speculative-config")) == vllm_speculative_config(cache.config)
    assert option(argv, "--scheduling-policy") == "priority"
    assert "--enforce-eager" in argv and command.env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    text = command.shell()
    assert (
        f"SwiftKV checkpoint ({config['num_key_value_layers']} of {config['num_hidden_layers']} layers"
        in text
        and f"-round(score * {PRIORITY_SCALE})" in text
    )
    assert shlex.split(text.splitlines()[-1])[1:] == argv  # pasteable: quoting survives the shell


def test_plain_checkpoint_prints_plain_command(tmp_path):
    tiny_base("llama").save_pretrained(tmp_path / "base")
    command = serve_command(tmp_path / "base")
    assert command.notes == [] and command.env == {}
    assert command.argv[3:] == ["--model", str(tmp_path / "base"), "--port", "8000"]


@pytest.mark.parametrize(
    "problem, match",
    [
        ("no-checkpoint", "is not a directory"),
        ("other-tokenizer", "built with tokenizer .* rebuild it with"),
        ("ranker-other-model", "reads pooled hidden states of size 96 .* train the ranker on this model"),
        ("ranker-missing", "ranker.json not found"),
    ],
)
def test_refusals_are_one_line(checkpoint, tmp_path, problem, match):
    kwargs = {}
    if problem == "other-tokenizer":
        save_cache(filled_cache(), tmp_path / "cache", word_tokenizer(offset=1))
        kwargs["suffix_cache"] = tmp_path / "cache"
    elif problem == "ranker-other-model":
        other = tmp_path / "other"
        tiny_base("llama", hidden_size=48).save_pretrained(other)
        word_tokenizer().save_pretrained(other)
        kwargs["ranker"] = trained_ranker(other, tmp_path / "ranker")
    elif problem == "ranker-missing":
        kwargs["ranker"] = tmp_path
    target = tmp_path / "missing" if problem == "no-checkpoint" else checkpoint
    with pytest.raises((ValueError, FileNotFoundError), match=match) as info:
        serve_command(target, **kwargs)
    assert "\n" not in str(info.value)
    cli = subprocess.run(
        [sys.executable, "-m", "eval", "vllm-args", str(target)]
        + [arg for key, value in kwargs.items() for arg in (f"--{key.replace('_', '-')}", str(value))],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert cli.returncode == 2 and cli.stdout == "" and cli.stderr.count("\n") == 1


@pytest.mark.vllm
@pytest.mark.slow  # imports vLLM in its venv
def test_vllm_parser_accepts_the_command(checkpoint, ranker, vllm_python, tmp_path):
    save_cache(filled_cache(), tmp_path / "cache", word_tokenizer())
    argv = serve_command(checkpoint, tmp_path / "cache", ranker, cpu=True).argv
    script = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]))
print(json.dumps([args.model, args.speculative_config, args.scheduling_policy, args.enforce_eager,
                  args.kv_cache_memory_bytes]))
"""
    run = subprocess.run([vllm_python, "-c", script, *argv[3:]], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    model, spec, policy, eager, kv_bytes = json.loads(run.stdout.strip().splitlines()[-1])
    assert model == str(checkpoint) and policy == "priority" and eager and kv_bytes == 1 << 30
    assert spec == json.loads(option(argv, "--speculative-config"))
