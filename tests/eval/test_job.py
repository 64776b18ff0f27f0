"""The main job's quick mode and a one-candidate fraction sweep end to end from a non-editable install (the wheel
in a fresh venv, its ``swiftkv`` console script and ``python -m distill sweep`` run from an unrelated folder, so
CI catches a missing install step or package data), then a
rerun from the checkout through ``python -m toolkit`` (the same front door) that skips every stage.  And the job on a model of
the user's own, named by its Hub id (found offline in a local cache), distilled under ``accelerate launch``
and evaluated in bfloat16; a launch that fails ends in one line."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from helpers.chat import save_chat_model
from huggingface_hub import ModelCard

from distill.shipped import SHIPPED
from eval.cli import main
from eval.job import DEFAULT_RECIPE, QUICK

# offline, and without PYTHONPATH: the installed package must run on its own files
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# what `pip install .` needs from the checkout (the tests, docs and scripts are not part of the package)
NOT_PACKAGED = (
    ".git",
    "out",
    ".venv*",
    "__pycache__",
    "*.egg-info",
    "build",
    ".*cache",
    "tests",
    "docs",
    "scripts",
)
ONE_PROCESS = "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nuse_cpu: true\n"


def installed_python(tmp_path: Path) -> Path:
    """The python of a fresh venv holding the package as `pip install .` leaves it (a wheel, no editable
    link to the checkout); its dependencies come from this test environment's site-packages (a .pth line)."""
    src, dist, venv = tmp_path / "src", tmp_path / "dist", tmp_path / "venv"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(*NOT_PACKAGED))
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        str(src),
        "-w",
        str(dist),
    ]
    subprocess.run(build, check=True, capture_output=True, cwd=tmp_path, timeout=300)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = dist.glob("*.whl")
    install = [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    return python


@pytest.mark.smollm2
@pytest.mark.slow
def test_quick_job_from_the_installed_package_then_resume_from_the_checkout(smollm2, tmp_path):
    python = installed_python(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [python, "-c", "import eval.job as j, distill.sweep as s; print(j.__file__, s.RECIPE.parent)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=ENV,
    )
    module, recipes = where.stdout.split()
    assert module.startswith(str(tmp_path / "venv")) and Path(recipes, "swiftkv_smollm2_cpu.yaml").is_file()
    # the checks the docs tell a user to run are commands of the installed package
    for command in ("gpu-check", "gpu-check-vllm", "check-vllm-api"):
        helped = subprocess.run(
            [python.parent / "swiftkv", command, "--help"],
            capture_output=True,
            text=True,
            cwd=elsewhere,
            env=ENV,
        )
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: swiftkv {command} "), (
            helped.stderr
        )
    # shipped recipes and configs by name, outside the checkout: the installed files
    outputs = []
    for argv, expected in (
        (["recipes", "path", "accelerate/8gpu_zero2"], "8gpu_zero2.yaml"),
        (["recipes", "cp", "swiftkv_smollm2_cpu", "mine.yaml"], "copied swiftkv_smollm2_cpu to mine.yaml"),
        (["check", "swiftkv_llama3.1_8b", "--config", "accelerate/8gpu_zero3_offload", "--model-config",
          "model_configs/llama3.1_8b", "--no-data"], "8 process(es), DeepSpeed ZeRO-3"),  # its DeepSpeed JSON too
    ):  # fmt: skip
        named = subprocess.run(
            [python.parent / "swiftkv", *argv], capture_output=True, text=True, cwd=elsewhere, env=ENV
        )
        assert named.returncode == 0 and expected in named.stdout, named.stderr[-2000:]
        outputs.append(named.stdout)
    assert Path(outputs[0].strip()).is_relative_to((tmp_path / "venv").resolve())
    shipped = Path(recipes, "swiftkv_smollm2_cpu.yaml")
    assert (elsewhere / "mine.yaml").read_bytes() == shipped.read_bytes()
    # `swiftkv distill NAME` loads the installed recipe (refused here on an override, before any work)
    refused = subprocess.run(
        [python.parent / "swiftkv", "distill", "swiftkv_smollm2_cpu", "train.max_step=1"],
        capture_output=True, text=True, cwd=elsewhere, env=ENV,
    )  # fmt: skip
    assert refused.returncode == 2 and f"recipe {shipped}: train.max_step" in refused.stderr, refused.stderr

    args = ["run", "--quick", "--out", str(tmp_path / "run")]
    first = subprocess.run(
        [python.parent / "swiftkv", *args],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=ENV,
        timeout=1200,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    report = tmp_path / "run" / "report.md"
    assert str(report) in first.stdout
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [v["name"] for v in run["variants"]] == ["original", "swiftkv50"]
    original, swift = run["variants"]
    assert original["quality"]["kl"] == 0 and original["quality"]["top1_agreement"] == 1  # teacher = itself
    assert swift["quality"]["kl"] > 0 and swift["distill"]["eval_kl"] > 0
    assert "swiftkv50" in report.read_text()
    # the quick recipe evaluates at steps 0 and 4 (the final one): the distillation's curve reaches the report
    curve = swift["distill"]["curve"]
    assert [(r["step"], r["train_tokens"]) for r in curve] == [(0, 0), (4, 4 * 2 * 128)]
    # the weights moved; whether 4 steps lower the KL is not this test's question: with the recipe's exact K/V the
    # converted start is already within ~0.03 nats on the 48 held-out tokens (learning: tests/distill/test_train.py)
    assert curve[-1]["eval_kl"] == swift["distill"]["eval_kl"] != curve[0]["eval_kl"]
    assert "| swiftkv50 (this job) | 4 | 1,024 |" in report.read_text()
    assert (tmp_path / "run" / "quality_vs_tokens.png").stat().st_size > 1000
    # `python -m distill sweep` from the installed package: its default recipe is package data
    tiny = [*QUICK.distill_overrides, "train.max_steps=2"]
    sweep_out = tmp_path / "sweep"
    sweep = subprocess.run(
        [
            python,
            "-m",
            "distill",
            "sweep",
            str(smollm2),
            "--out",
            str(sweep_out),
            "--fractions",
            "0.25",
            *tiny,
        ],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=ENV,
        timeout=900,
    )
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    (result,) = json.loads((sweep_out / "sweep.json").read_text())["results"]
    assert abs(result["fraction"] - 0.25) <= 1 / 30 and result["steps"] == 2 and result["kl"] > 0
    assert (sweep_out / "stages" / f"l{result['num_key_value_layers']}.json").is_file()
    checkout = {**ENV, "PYTHONPATH": str(ROOT)}  # this checkout's code
    second = subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=checkout,
        timeout=600,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[distill-swiftkv50] up to date, skipped" in second.stdout
    assert "running" not in second.stdout


@pytest.mark.smollm2  # the job's held-out data is the embedded ShareGPT
@pytest.mark.slow
def test_job_on_a_hub_id_launched_and_evaluated_in_bfloat16(sharegpt, hub, tmp_path):
    home, commit = hub  # the job runs in a subprocess: HF_HOME below points it at the same cache
    out, launch = tmp_path / "run", tmp_path / "one_process.yaml"
    launch.write_text(ONE_PROCESS)
    cmd = [
        "-m",
        "toolkit",
        "run",
        "acme/tiny-chat",
        "--quick",
        "--dtype",
        "bfloat16",
        "--launch",
        str(launch),
    ]
    cmd += ["--out", str(out)]
    env = {**ENV, "HF_HOME": str(home)}
    result = subprocess.run(
        [sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert (run["meta"]["model"], run["meta"]["device"], run["meta"]["dtype"]) == (
        "acme/tiny-chat",
        "cpu",
        "bfloat16",
    )
    original, swift = run["variants"]
    assert original["dir"].endswith(f"models--acme--tiny-chat/snapshots/{commit}")
    assert swift["quality"]["dtype"] == "bfloat16" and swift["quality"]["kl"] > 0
    assert run["commands"][0] == shlex.join(
        [
            "swiftkv",
            "run",
            "acme/tiny-chat",
            "--out",
            str(out),
            "--dtype",
            "bfloat16",
            "--launch",
            str(launch),
            "--quick",
        ]
    )
    assert run["commands"][1].startswith(f"swiftkv convert {original['dir']} {out / 'convert-swiftkv50'} ")
    launched = out / "recipes" / "distill-swiftkv50.yaml"  # the typed recipe the launch trained
    assert run["commands"][2] == f"accelerate launch --config_file {launch} -m distill {launched}"
    student = yaml.safe_load(launched.read_text())
    assert student["model"]["source"] == str(out / "convert-swiftkv50")
    assert student["model"]["swiftkv"]["fraction"] == 0.5 and student["train"]["max_steps"] == 4
    assert (
        swift["distill"]["eval_kl"] > 0 and len(swift["distill"]["curve"]) == 2
    )  # read back from the launch
    assert "# SwiftKV report: acme/tiny-chat" in (out / "report.md").read_text()
    card = ModelCard.load(Path(swift["dir"]) / "README.md")  # the job's measured quality, in the card
    assert card.data.base_model == "acme/tiny-chat"
    assert "`swiftkv run` (bfloat16 on cpu)" in card.text
    assert f"| kl | {swift['quality']['kl']:.4g} |" in card.text


@pytest.mark.smollm2  # the job's held-out data is the embedded ShareGPT
def test_a_failed_launch_ends_in_one_line_below_the_distillations_own(sharegpt, tmp_path, capfd):
    recipe, launch = tmp_path / "powersgd.yaml", tmp_path / "one_process.yaml"
    # a DDP hook on one process: the launched distillation refuses it in one line, before any work
    recipe.write_text((SHIPPED / DEFAULT_RECIPE).read_text() + "comm: {hook: powersgd}\n")
    launch.write_text(ONE_PROCESS)
    model, out = save_chat_model(tmp_path / "tiny"), tmp_path / "run"
    argv = ["run", str(model), "--quick", "--recipe", str(recipe), "--launch", str(launch), "--out", str(out)]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    *_, child, last = err.strip().splitlines()
    assert child.startswith("error: comm.hook=powersgd (staleness 0) cannot run on one process (to resolve, ")
    assert last == (
        f"error: the distillation into {out / 'distill-swiftkv50'} failed under accelerate launch "
        "(exit status 1) (to resolve, fix the error printed above and run the job again: the stages already "
        "done are skipped)"
    )
    assert not (out / "stages" / "distill-swiftkv50.json").exists()
