"""``swiftkv vllm-args``: the printed serve command carries the artifacts' settings, vLLM's own parser
accepts it, and mismatched or missing artifacts are refused with one line before anything is printed."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.chat import word_tokenizer
from helpers.models import tiny_base
from helpers.ranking import trained_ranker
from helpers.suffix import filled_cache

import swiftkv.convert
from eval.serving.suffix.artifact import save_cache, vllm_speculative_config
from eval.serving.vllm.args import PRIORITY_SCALE, serve_command
from toolkit.cli import main as front_door


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("vllm-args")
    tiny_base("llama").save_pretrained(tmp / "base")
    word_tokenizer().save_pretrained(tmp / "base")
    return swiftkv.convert.convert(tmp / "base", tmp / "swiftkv", swiftkv_fraction=0.5)


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
def test_refusals_are_one_line(checkpoint, tmp_path, problem, match, capsys):
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
    options = [arg for key, value in kwargs.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    capsys.readouterr()
    code = front_door(["vllm-args", str(target), *options])  # the front door, in-process
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1


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
