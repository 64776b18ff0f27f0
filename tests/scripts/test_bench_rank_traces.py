"""scripts/bench_rank_traces.py without vLLM: a fake engine that finishes replies out of order shows that each reply
is kept as it finishes, a run stops at its time limit, a rerun answers only the prompts still missing, and other
options or prompts are refused."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_rank_traces as brt  # noqa: E402

ROWS = [{"prompt": f"p{i}", "prompt_len": 4 + i} for i in range(10)]
META = {"model": "m", "max_new_tokens": 8}


class FakeEngine:
    """One reply finishes every 10 s of its clock, the shortest first (length = 1 + prompt number % 8, capped
    at 8); ``calls`` records (prompts asked, already written) per run."""

    def __init__(self):
        self.t, self.calls = 0.0, []

    def clock(self) -> float:
        return self.t

    def sample(self, todo, already, expired):
        self.calls.append(([r["prompt"] for r in todo], already))
        lengths = [1 + int(r["prompt"][1:]) % 8 for r in todo]
        for k in sorted(range(len(todo)), key=lambda k: lengths[k]):
            if expired():
                return
            self.t += 10.0
            yield k, lengths[k], lengths[k] < 8


def test_replies_are_kept_as_they_finish_and_a_rerun_answers_the_rest(tmp_path):
    fake = FakeEngine()
    first = brt.generate(ROWS, tmp_path, META, fake.sample, time_limit=35, clock=fake.clock)
    assert first["done"] == 4 and not first["complete"] and first["generation_s"] == 40
    kept = brt.done_rows(tmp_path / "traces.jsonl")
    assert [r["prompt"] for r in kept] == ["p0", "p8", "p1", "p9"]  # in the order they finished
    with open(tmp_path / "traces.jsonl", "a") as f:
        f.write('{"prompt": "p2", "prom')  # a run killed mid-line
    second = brt.generate(ROWS, tmp_path, META, fake.sample, time_limit=1e9, clock=fake.clock)
    assert second["complete"] and second["done"] == 10 and second["generation_s"] == 100
    assert fake.calls[1] == (["p2", "p3", "p4", "p5", "p6", "p7"], 4)
    rows = {r["prompt"]: r for r in brt.done_rows(tmp_path / "traces.jsonl")}
    assert len(rows) == 10 and rows["p7"] == {
        "prompt": "p7",
        "prompt_len": 11,
        "output_len": 8,
        "finished": False,
    }
    assert json.loads((tmp_path / "meta.json").read_text())["complete"]
    brt.generate(ROWS, tmp_path, META, fake.sample, time_limit=1e9, clock=fake.clock)
    assert len(fake.calls) == 2  # nothing left: no engine started


def test_other_options_or_prompts_are_refused(tmp_path):
    fake = FakeEngine()
    brt.generate(ROWS[:3], tmp_path, META, fake.sample, 1e9, fake.clock)
    with pytest.raises(ValueError, match="other options"):
        brt.generate(ROWS, tmp_path, {**META, "max_new_tokens": 9}, fake.sample, 1e9, fake.clock)
    with pytest.raises(ValueError, match="prompts the source does not"):
        brt.generate(ROWS[5:], tmp_path, META, fake.sample, 1e9, fake.clock)


def test_bad_input_is_one_line(tmp_path, capsys):
    assert brt.main([str(tmp_path / "none"), str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
