"""The main job's configuration (``eval.job.JobConfig``): two presets that validate themselves, a user's choices
applied to them with bad ones refused in one line, and the command line a run records reproducing the config."""

from __future__ import annotations

import pytest

from eval.cli import build_parser, job_from_args
from eval.job import FULL, QUICK, JobConfig, job_config
from toolkit.cliargs import UsageError


def test_presets_are_valid_configs_and_differ_only_in_size():
    assert FULL.fractions == [0.25, 0.5] and QUICK.fractions == [0.5] and QUICK.quick and not FULL.quick
    assert QUICK.quality.n_conversations < FULL.quality.n_conversations
    assert QUICK.run_dir.name == "demo-quick" and FULL.run_dir.name == "demo"
    with pytest.raises(ValueError, match=r"must lie in \(0, 1\)"):
        JobConfig.model_validate(FULL.model_dump() | {"fractions": [2.0]})


@pytest.mark.parametrize(
    "choices, message",
    [
        (
            {"fractions": [0.5, 1.5]},
            "fractions: fractions [0.5, 1.5] must lie in (0, 1), e.g. 0.25,0.5 (to resolve, pass another --fractions)",
        ),
        (
            {"distill_steps": 0},
            "distill_steps: Input should be greater than or equal to 1 (to resolve, pass another --distill-steps)",
        ),
        (
            {"fractions": []},
            "fractions: List should have at least 1 item after validation, not 0 (to resolve, pass another --fractions)",
        ),
    ],
)
def test_bad_choices_are_one_line(choices, message):
    with pytest.raises(UsageError) as e:
        job_config(False, **choices)
    assert str(e.value) == message


@pytest.mark.parametrize("quick", [False, True])
def test_the_recorded_command_reproduces_the_config(quick, tmp_path):
    (tmp_path / "launch.yaml").write_text("num_processes: 1\n")
    config = job_config(
        quick,
        model="acme/tiny-chat",
        out=tmp_path / "run",
        fractions=[0.3],
        distill_steps=7,
        dtype="bfloat16",
        launch=tmp_path / "launch.yaml",
    )
    argv = config.command().split()[1:]  # after `swiftkv`
    again = job_from_args(build_parser().parse_args(argv))
    assert again == config
