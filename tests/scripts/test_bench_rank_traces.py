"""scripts/bench_rank_traces.py without vLLM: a fake sampler shows that runs resume after the last complete chunk,
stop before the time limit, and refuse other options or prompts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_rank_traces as brt  # noqa: E402

ROWS = [{"prompt": f"p{i}", "prompt_len": 4 + i} for i in range(10)]
META = {"model": "m", "max_new_tokens": 8}


class Clock:
    """The time of the fake sampler, whose every chunk takes 10 s."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def sampler(calls: list, clock: Clock | None = None):
    def sample(part, first):  # the length depends on the request's index only, like a per-request seed
        calls.append((first, len(part)))
        if clock is not None:
            clock.t += 10.0
        return [((first + i) % 8 + 1, (first + i) % 8 != 7) for i in range(len(part))]

    return sample


def test_resumes_within_the_time_limit_and_equals_one_run(tmp_path):
    calls, clock = [], Clock()
    first = brt.generate(
        ROWS, tmp_path / "a", META, sampler(calls, clock), chunk=3, time_limit=25, clock=clock
    )
    assert calls == [(0, 3), (3, 3)] and first["done"] == 6 and not first["complete"]  # a third: 30 s > 25
    assert first["generation_s"] == 20
    with open(tmp_path / "a" / "traces.jsonl", "a") as f:
        f.write('{"prompt": "p6", "prom')  # a run killed mid-line
    brt.generate(ROWS, tmp_path / "a", META, sampler(calls), chunk=3, time_limit=1e9, clock=Clock())
    assert calls[2:] == [(6, 3), (9, 1)]
    whole = brt.generate(ROWS, tmp_path / "b", META, sampler([]), chunk=4, time_limit=1e9, clock=Clock())
    assert whole["complete"] and json.loads((tmp_path / "a" / "meta.json").read_text())["complete"]
    assert (tmp_path / "a" / "traces.jsonl").read_text() == (tmp_path / "b" / "traces.jsonl").read_text()
    rows = brt.done_rows(tmp_path / "b" / "traces.jsonl")
    assert [r["output_len"] for r in rows] == [i % 8 + 1 for i in range(10)] and not rows[7]["finished"]
    calls.clear()
    brt.generate(ROWS, tmp_path / "b", META, sampler(calls), chunk=4, time_limit=1e9, clock=Clock())
    assert calls == []  # nothing left: no engine call


def test_other_options_or_prompts_are_refused(tmp_path):
    brt.generate(ROWS, tmp_path, META, sampler([]), chunk=5, time_limit=1e9, clock=Clock())
    with pytest.raises(ValueError, match="other options"):
        brt.generate(ROWS, tmp_path, {**META, "max_new_tokens": 9}, sampler([]), 5, 1e9, Clock())
    with pytest.raises(ValueError, match="other prompts"):
        brt.generate(ROWS[::-1], tmp_path, META, sampler([]), 5, 1e9, Clock())


def test_bad_input_is_one_line(tmp_path, capsys):
    assert brt.main([str(tmp_path / "none"), str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
