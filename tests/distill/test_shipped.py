"""Shipped recipes and launcher configs by name (``distill.shipped``, ``swiftkv recipes``): every file under
``recipes/`` that a command takes is listed with a line and found by its name and by its checkout path from any
folder; an unknown name is one line naming the close matches; ``cp`` copies a file byte for byte and refuses to
replace one; a shipped accelerate config's DeepSpeed file resolves outside the checkout.  From an installed wheel:
tests/eval/test_job.py."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from distill.__main__ import main as distill_main
from distill.check import main as check_main
from distill.recipe import load_recipe
from distill.shipped import SHIPPED, deepspeed_config, find, main, normalize, shipped
from toolkit.cli import main as front_door

CHECKOUT = ROOT / "recipes"


def one_line_refusal(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and "(to resolve, " in err, err
    return err


def test_every_shipped_file_is_listed_with_a_line_and_found_by_name_and_checkout_path(capsys, monkeypatch):
    files = shipped()
    on_disk = {p for p in CHECKOUT.rglob("*") if p.suffix in (".yaml", ".json")}
    assert {f.path.resolve() for f in files.values()} == {p.resolve() for p in on_disk}
    assert SHIPPED.resolve() == CHECKOUT.resolve()  # the package data is the checkout's recipes/
    monkeypatch.chdir(ROOT.parent)  # no recipes/ here: only the shipped files can answer
    assert front_door(["recipes"]) == 0
    listing = capsys.readouterr().out
    for name, file in files.items():
        line = next(line for line in listing.splitlines() if line.split()[:1] == [name])
        assert len(line.split()) > 2, line  # a description
        assert find(name, file.kind) == file.path
        checkout_path = f"recipes/{file.path.relative_to(SHIPPED).as_posix()}"
        assert normalize(checkout_path) == name and find(checkout_path, file.kind) == file.path
    assert "accelerate/8gpu_zero2" in listing and "8 processes on 1 node, DeepSpeed ZeRO-2" in listing
    assert main(["path", "model_configs/llama3.1_8b"]) == 0
    assert capsys.readouterr().out.strip() == str(
        (SHIPPED / "model_configs/llama3.1_8b/config.json").resolve()
    )


def test_an_existing_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "swiftkv_smollm2_cpu"
    mine.write_text("output_dir: x\n")
    assert find("swiftkv_smollm2_cpu", "recipe") == Path("swiftkv_smollm2_cpu")  # the user's file
    assert find("swiftkv_smollm2_cpu.yaml", "recipe") == SHIPPED / "swiftkv_smollm2_cpu.yaml"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["recipes", "path", "accelerate/8gpu_zero"],
            "shipped recipe or config accelerate/8gpu_zero not found",
        ),
        (["recipes", "cp", "swiftkv_llama3_8b"], "swiftkv_llama3.1_8b"),
        (["distill", "swiftkv_llama3_8b"], "recipe swiftkv_llama3_8b not found"),
        (["check", "swiftkv_llama3.1_8b", "--config", "accelerate/8gpu_zero"], "accelerate/8gpu_zero2"),
        (["check", "swiftkv_llama3.1_8b", "--model-config", "llama3.1_8b"], "model_configs/llama3.1_8b"),
        (["cluster", "trace", "cluster/clusters", "--out", "t.csv"], "cluster/cluster"),
    ],
)
def test_an_unknown_name_is_one_line_with_the_close_matches(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert front_door(argv) == 2
    err = one_line_refusal(capsys)
    assert expected in err and "`swiftkv recipes` lists them" in err
    assert list(tmp_path.iterdir()) == []


def test_a_name_far_from_every_recipe_lists_the_recipes(capsys):
    assert distill_main(["no-such-thing"]) == 2
    err = one_line_refusal(capsys)
    assert all(name in err for name in shipped("recipe")) and "accelerate/" not in err


def test_cp_copies_byte_for_byte_and_refuses_to_replace(tmp_path, capsys):
    dest = tmp_path / "mine.yaml"
    assert main(["cp", "swiftkv_llama3.1_8b", str(dest)]) == 0
    assert capsys.readouterr().out.strip() == f"copied swiftkv_llama3.1_8b to {dest}"
    assert dest.read_bytes() == (CHECKOUT / "swiftkv_llama3.1_8b.yaml").read_bytes()
    assert load_recipe(dest) == load_recipe(find("swiftkv_llama3.1_8b", "recipe"))
    dest.write_text("edited\n")
    assert main(["cp", "swiftkv_llama3.1_8b", str(dest)]) == 2
    assert "mine.yaml exists (to resolve, pass another DEST or --force)" in one_line_refusal(capsys)
    assert dest.read_text() == "edited\n"
    assert main(["cp", "swiftkv_llama3.1_8b", str(dest), "--force"]) == 0
    assert dest.read_bytes() == (CHECKOUT / "swiftkv_llama3.1_8b.yaml").read_bytes()
    folder = tmp_path / "configs/"  # a folder that does not exist yet, named as one
    assert main(["cp", "recipes/accelerate/8gpu_zero3.yaml", f"{folder}/"]) == 0
    copied = folder / "8gpu_zero3.yaml"
    assert copied.read_bytes() == (CHECKOUT / "accelerate/8gpu_zero3.yaml").read_bytes()


def test_a_shipped_accelerate_config_finds_its_deepspeed_file_from_any_folder(tmp_path, monkeypatch, capsys):
    """The accelerate configs name recipes/deepspeed/NAME.json: ``swiftkv check`` reads the shipped one from a
    folder without recipes/, and so does the training process (``deepspeed_config``, what accelerate passes it in
    ACCELERATE_DEEPSPEED_CONFIG_FILE); a file of that name in the folder, or inline JSON, is used as it is."""
    monkeypatch.chdir(tmp_path)
    argv = ["swiftkv_llama3.1_8b", "--config", "accelerate/8gpu_zero3_offload"]
    assert check_main([*argv, "--model-config", "model_configs/llama3.1_8b", "--no-data"]) == 0
    out = capsys.readouterr().out
    assert "recipe swiftkv_llama3.1_8b: valid" in out and "8 process(es), DeepSpeed ZeRO-3" in out
    assert deepspeed_config("recipes/deepspeed/zero2.json") == str(SHIPPED / "deepspeed/zero2.json")
    inline = json.dumps({"zero_optimization": {"stage": 2}})
    encoded = base64.urlsafe_b64encode(
        json.dumps({"zero_optimization": {"stage": 3}, "x": "y" * 400}).encode()
    )
    assert deepspeed_config(inline) == inline and deepspeed_config(encoded.decode()) == encoded.decode()
    (tmp_path / "recipes/deepspeed").mkdir(parents=True)
    (tmp_path / "recipes/deepspeed/zero2.json").write_text("{}")
    assert deepspeed_config("recipes/deepspeed/zero2.json") == "recipes/deepspeed/zero2.json"


def test_a_bad_override_of_a_shipped_recipe_is_refused_before_torch_is_imported(tmp_path):
    """`swiftkv distill NAME key=value` checks the recipe before the training stack loads: the one-line refusal
    comes from a process that never imported torch or transformers."""
    probe = (
        "import sys; from distill.__main__ import main; rc = main(['swiftkv_smollm2_cpu', 'train.max_step=1']); "
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=None
    )
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "train.max_step: unknown key" in proc.stderr
