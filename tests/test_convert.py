"""Converter: design names and init, save/load round trip, remote-code loading, every refusal leaves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_base
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import swiftkv.convert  # registers the Auto classes too
from swiftkv.cli import main as cli

L = 6


def design_keys(l: int, g: int, bias: bool = False) -> set[str]:
    suffixes = ("weight", "bias") if bias else ("weight",)
    keys = {"model.norm_swiftkv.weight"}
    keys |= {f"model.layers.{j}.self_attn.q_proj_swiftkv.{s}" for j in range(l, L) for s in suffixes}
    keys |= {
        f"model.layers.{j}.self_attn.{p}_proj_swiftkv.{s}"
        for j in range(l, L, g)
        for p in "kv"
        for s in suffixes
    }
    return keys


def test_convert_names_init_and_round_trip(tiny_llama_dir, tmp_path):
    dst = tmp_path / "swift"
    swiftkv.convert.convert(tiny_llama_dir, dst, num_key_value_layers=2, group_size=2)
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["LlamaSwiftKVForCausalLM"] and config["model_type"] == "llama_swiftkv"
    assert (config["num_key_value_layers"], config["key_value_group_size"], config["swiftkv"]) == (2, 2, True)
    assert json.loads((dst / "provenance.json").read_text())["stage"] == "swiftkv convert"

    base = load_file(tiny_llama_dir / "model.safetensors")
    out = load_file(dst / "model.safetensors")
    assert set(out) - set(base) == design_keys(2, 2)
    for k in base:  # every original weight kept bit for bit (they are the teacher)
        assert torch.equal(out[k], base[k]), k
    attn = "model.layers.{}.self_attn.{}.weight"
    assert torch.equal(out["model.norm_swiftkv.weight"], base["model.layers.2.input_layernorm.weight"])
    assert torch.equal(out[attn.format(3, "q_proj_swiftkv")], base[attn.format(3, "q_proj")])
    mean = (base[attn.format(4, "k_proj")] + base[attn.format(5, "k_proj")]) / 2
    torch.testing.assert_close(out[attn.format(4, "k_proj_swiftkv")], mean)

    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    ids = torch.randint(3, 128, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_qwen2_biases_get_twins(tmp_path):
    src = tmp_path / "qwen"
    tiny_base("qwen2").save_pretrained(src)
    swiftkv.convert.convert(src, tmp_path / "swift", swiftkv_fraction=0.5)
    out = load_file(tmp_path / "swift" / "model.safetensors")
    assert design_keys(3, 1, bias=True) <= set(out)
    assert json.loads((tmp_path / "swift" / "config.json").read_text())["architectures"] == [
        "Qwen2SwiftKVForCausalLM"
    ]


def test_sharded_source_and_dtype(tmp_path):
    src = tmp_path / "sharded"
    tiny_base("llama").save_pretrained(src, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    dst = swiftkv.convert.convert(src, tmp_path / "swift", num_key_value_layers=3, dtype="bfloat16")
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert design_keys(3, 1) <= set(index)
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.model.layers[4].self_attn.q_proj_swiftkv.weight.dtype == torch.bfloat16


def test_trust_remote_code_in_a_process_that_never_imports_the_package(tiny_llama_dir, tmp_path):
    dst = swiftkv.convert.convert(tiny_llama_dir, tmp_path / "swift", num_key_value_layers=3)
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True).eval()\n"
        "assert 'swiftkv' not in sys.modules, 'the package was imported'\n"
        "ids = torch.arange(3, 13)[None]\n"
        "with torch.no_grad(): print(type(m).__name__, float(m(ids).logits.sum()))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    name, total = result.stdout.split()
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        expected = float(model(torch.arange(3, 13)[None]).logits.sum())
    assert name == "LlamaSwiftKVForCausalLM" and abs(float(total) - expected) < 1e-3


def _corrupt_weights(src: Path) -> None:
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _unknown_arch(src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))


@pytest.mark.parametrize(
    "args,prepare,message",
    [
        (["--num-key-value-layers", "0"], None, "num_key_value_layers=0 is outside [1, 6]"),
        (["--num-key-value-layers", "7"], None, "num_key_value_layers=7 is outside [1, 6]"),
        (
            ["--num-key-value-layers", "3", "--group-size", "2"],
            None,
            "group size 2 does not divide the 3 SwiftKV layers",
        ),
        (["--swiftkv-fraction", "0.5"], _unknown_arch, "unsupported architecture 'gpt2'"),
        (["--swiftkv-fraction", "0.5"], _corrupt_weights, "is corrupt or truncated"),
        (
            ["--swiftkv-fraction", "0.5"],
            lambda s: (s / "config.json").write_text("{oops"),
            "config.json is corrupt",
        ),
        (
            ["--swiftkv-fraction", "0.5"],
            lambda s: (s / "model.safetensors").unlink(),
            "has no safetensors weights",
        ),
    ],
)
def test_refusals_leave_no_output(tiny_llama_dir, tmp_path, capsys, args, prepare, message):
    if prepare:
        prepare(tiny_llama_dir)
    dst = tmp_path / "out"
    assert message in refused(capsys, ["convert", str(tiny_llama_dir), str(dst), *args])
    assert not dst.exists() and not list(tmp_path.glob(".out*"))


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI on bad input: exit status 2, nothing on stdout, one ``error: ...`` line on stderr."""
    capsys.readouterr()
    assert cli(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_refuses_missing_source_existing_destination_and_swiftkv_source(tiny_llama_dir, tmp_path, capsys):
    argv = ["convert", str(tmp_path / "nope"), str(tmp_path / "a"), "--swiftkv-fraction", "0.5"]
    assert "does not exist" in refused(capsys, argv)
    dst = tmp_path / "swift"
    cli(["convert", str(tiny_llama_dir), str(dst), "--swiftkv-fraction", "0.5"])
    argv = ["convert", str(tiny_llama_dir), str(dst), "--swiftkv-fraction", "0.25"]
    assert "is not empty; to resolve, pass --force" in refused(capsys, argv)
    assert json.loads((dst / "config.json").read_text())["num_key_value_layers"] == 3  # untouched
    cli(["convert", str(tiny_llama_dir), str(dst), "--swiftkv-fraction", "0.25", "--force"])
    assert json.loads((dst / "config.json").read_text())["num_key_value_layers"] == 4
    argv = ["convert", str(dst), str(tmp_path / "b"), "--swiftkv-fraction", "0.5"]
    assert "already a SwiftKV checkpoint" in refused(capsys, argv)
    assert not (tmp_path / "b").exists()


@pytest.mark.smollm2
def test_smollm2_convert_and_generate(smollm2, tmp_path):
    from transformers import AutoTokenizer

    dst = swiftkv.convert.convert(smollm2, tmp_path / "smol", swiftkv_fraction=0.5, group_size=1)
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert model.config.num_key_value_layers == 15
    tok = AutoTokenizer.from_pretrained(dst)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Name a primary color."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    outs = {}
    for mode in ("teacher", "student"):
        model.set_mode(mode)
        with torch.no_grad():
            outs[mode] = model.generate(**ids, max_new_tokens=12, do_sample=False)
    base = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    with torch.no_grad():
        assert outs["teacher"].tolist() == base.generate(**ids, max_new_tokens=12, do_sample=False).tolist()
        model.set_mode("student")
        full = model(outs["student"][:, :-1], use_cache=False).logits.argmax(-1)
    n = ids["input_ids"].shape[1]
    assert full[0, n - 1 :].tolist() == outs["student"][0, n:].tolist()  # cached skip-ahead = full pass


def test_mistral_style_checkpoint_maps_onto_llama(tmp_path, capsys):
    from conftest import TINY
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    base = MistralForCausalLM(MistralConfig(**TINY, sliding_window=None)).eval()
    base.save_pretrained(tmp_path / "mistral")
    dst = swiftkv.convert.convert(tmp_path / "mistral", tmp_path / "swift", num_key_value_layers=4)
    model = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(model).__name__ == "LlamaSwiftKVForCausalLM"
    model.set_mode("teacher")
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, atol=1e-5, rtol=0)
    config = json.loads((tmp_path / "mistral" / "config.json").read_text())
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    argv = ["convert", str(tmp_path / "mistral"), str(tmp_path / "b"), "--swiftkv-fraction", "0.5"]
    assert "sliding window are not supported" in refused(capsys, argv)


def test_info_prints_layout_and_savings(tiny_llama_dir, tmp_path, capsys):
    cli(
        [
            "convert",
            str(tiny_llama_dir),
            str(tmp_path / "s"),
            "--num-key-value-layers",
            "2",
            "--group-size",
            "2",
        ]
    )
    capsys.readouterr()
    cli(["info", str(tmp_path / "s"), "--lengths", "64,128"])
    out = capsys.readouterr().out
    assert "layers 0..1 normal; layers 2..5 SwiftKV (4 layers, 67%), group size 2 -> 2 KV groups" in out
    assert "original 768, SwiftKV 512 (66.7%)" in out  # 6 vs 2 + 2 slots of 2 x 2 heads x 16 dims x 2 bytes
    assert len([line for line in out.splitlines() if line.strip().startswith(("64 ", "128 "))]) == 2
