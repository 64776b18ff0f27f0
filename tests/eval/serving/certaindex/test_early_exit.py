"""Certaindex logic without a model: answer extraction/equality, the exit rule, certaindex, SC stopping."""

from __future__ import annotations

import math
from concurrent.futures import Future

import pytest

from eval.serving.certaindex.answers import (
    answers_equal,
    extract_final_answer,
    extract_probe_answer,
    is_hesitant,
)
from eval.serving.certaindex.backends import Completion, Sampling
from eval.serving.certaindex.certainty import (
    PRESETS,
    Probe,
    certaindex,
    cluster,
    majority,
    preset,
    should_exit,
)
from eval.serving.certaindex.cot import final_answer_block, run_cot
from eval.serving.certaindex.data import arithmetic, load_problems
from eval.serving.certaindex.sc import calibrate, replay, run_sc


@pytest.mark.parametrize(
    ("probe_text", "answer"),
    [
        ("42} \\]", "42"),
        ("\\frac{1}{2}} \\]\nso", "\\frac{1}{2}"),  # nested braces kept, first unmatched one ends it
        ("{a}_{b}}", "{a}_{b}"),
        ("  7 }", "7"),
        ("42", ""),  # box never closed: no answer
        ("\\frac{1}{2", ""),
        ("}", ""),
    ],
)
def test_extract_probe_answer(probe_text, answer):
    assert extract_probe_answer(probe_text) == answer


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so \\boxed{3} then \\boxed{\\frac{1}{2}} end", "\\frac{1}{2}"),
        ("Step 1: 12 + 7 = 19\nThe answer is 19.", "19"),
        ("So the answer is 5 * 5 = 25 marbles.", "25 marbles"),
        ("12 + 7 = 19 apples", "19"),
        ("no numbers here", ""),
        ("4 x 6 = 24, so 26 pens in total.\n\nThe answer is \\boxed{}.", "26"),  # empty box: fall back
    ],
)
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


def test_extract_final_answer_multiple_choice_takes_last_letter():
    assert extract_final_answer("A looks wrong, so \\boxed{C}", choices=4) == "C"
    assert extract_final_answer("I think (B) is right. B", choices=4) == "B"
    assert extract_final_answer("E is not an option", choices=4) == ""


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("1/2", "\\frac{1}{2}"),
        ("0.5", "\\dfrac{1}{2}"),
        ("21 apples", "21"),
        ("21\\text{ apples}", "21"),
        ("$1,000$", "1000"),
        ("50\\%", "0.5"),
        ("x + 1", "1+x"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\frac{\\frac{1}{2}}{2}", "0.25"),
        ("B", "b"),
    ],
)
def test_equal_answers(a, b):
    assert answers_equal(a, b) and answers_equal(b, a)


@pytest.mark.parametrize(
    ("a", "b"), [("3", "4"), ("", ""), ("", "0"), ("x+1", "x-1"), ("\\frac{1}{3}", "0.33"), ("A", "B")]
)
def test_unequal_answers(a, b):
    assert not answers_equal(a, b)


def test_hesitation_words_are_whole_words():
    assert is_hesitant("Wait, it is 5") and is_hesitant("5 but maybe 6") and is_hesitant("HMM")
    assert not is_hesitant("I know the number is 5")  # "no" inside "know", "number"
    assert not is_hesitant("the button")


def P(answer: str, text: str | None = None) -> Probe:
    return Probe(text if text is not None else f"{answer}}} \\]", answer)


def test_exit_when_last_window_agrees():
    assert should_exit([P("5"), P("5"), P("5")], 3)
    assert should_exit(
        [P("7"), P("1/2"), P("0.5"), P("\\frac{1}{2}")], 3
    )  # equal by value, earlier noise ignored


@pytest.mark.parametrize(
    "probes",
    [
        [P("5"), P("5")],  # fewer probes than the window
        [P("5"), P("5"), P("6")],  # inconsistent
        [P("5"), P("6"), P("5")],
        [P("5"), P(""), P("5")],  # one empty answer
        [P(""), P(""), P("")],  # all empty: equal to each other as strings, still no answer
        [P("5"), P("5", "Wait, 5} \\]"), P("5")],  # hesitation in a probe that is not the latest
        [P("5"), P("5"), P("5", "5} hmm")],  # hesitation in the latest probe
        [P("5"), P("5"), P("5"), P("6")],  # agreement broken by the latest probe
    ],
)
def test_no_exit_unless_every_condition_holds(probes):
    """Each sequence fails exactly one exit condition; an exit check that always passes exits here."""
    assert not should_exit(probes, 3)


def test_window_and_presets():
    assert (
        preset("mid") == (3, 64)
        and PRESETS["crazy"] == (2, 32)
        and [w for w, _ in PRESETS.values()] == [8, 5, 3, 2, 2]
    )
    with pytest.raises(ValueError, match="unknown preset 'fast'; to resolve, use one of mild"):
        preset("fast")
    with pytest.raises(ValueError, match="window must be >= 1"):
        should_exit([P("5")], 0)
    assert should_exit([P("6"), P("5")], 1) and not should_exit([P("5"), P("")], 1)


def test_certaindex_on_known_multisets():
    assert certaindex(["4", "4", "4", "4"]) == pytest.approx(1.0)
    assert certaindex(["1/2", "0.5", "\\frac{1}{2}"]) == pytest.approx(1.0)  # one cluster by value
    assert certaindex(["1", "2", "3", "4"]) == pytest.approx(0.0)
    assert certaindex(["", "", ""]) == pytest.approx(0.0)  # empty answers never agree
    assert certaindex(["1", "1", "2", "2"]) == pytest.approx(0.5)  # (log 4 - log 2) / log 4
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert certaindex(["7", "7", "7", "8"]) == pytest.approx((math.log(4) - h) / math.log(4))
    assert certaindex(["7"]) == 0.0 and certaindex([]) == 0.0
    assert cluster(["1", "2", "1.0", ""]) == [[0, 2], [1], [3]]
    assert majority(["", "", "3", "2", "3"]) == "3" and majority(["", ""]) == ""


class ScriptedBackend:
    """An engine double: the chain grows by one fixed chunk per call, probes and samples follow scripts."""

    def __init__(self, probe_answers: list[str] = (), sample_answers: list[str] = (), chunk_tokens: int = 8):
        self.probe_answers, self.sample_answers, self.chunk_tokens = (
            list(probe_answers),
            list(sample_answers),
            chunk_tokens,
        )
        self.samples_drawn = 0

    def chat_format(self, question: str) -> str:
        return question

    def session(self, prompt: str):
        backend = self

        class Session:
            text = ""

            def extend(self, max_tokens: int, sampling: Sampling) -> Completion:
                n = min(max_tokens, backend.chunk_tokens)
                self.text += "x" * n
                return Completion("x" * n, n, n, False)

            def start_probe(self, suffix: str, max_tokens: int, sampling: Sampling) -> Future:
                answer = backend.probe_answers.pop(0)
                done = Future()
                done.set_result(Completion(answer + "} \\]", 3, 10, True))
                return done

        return Session()

    def sample(self, prompt: str, n: int, max_tokens: int, sampling: Sampling) -> list[Completion]:
        assert sampling.seed == self.samples_drawn  # rounds are seeded by the index of their first sample
        out = [Completion(f"\\boxed{{{a}}}", 10 + i, 5, True) for i, a in enumerate(self.sample_answers[:n])]
        self.sample_answers = self.sample_answers[n:]
        self.samples_drawn += n
        return out


def test_run_cot_exits_at_first_agreeing_window_and_accounts_tokens():
    backend = ScriptedBackend(["3", "5", "4", "4", "4", "9", "9"])
    result = run_cot(backend, "q", max_tokens=100, window=3, chunk=8)
    assert result.exited_early and result.answer == "4" and result.probe_answers == ["3", "5", "4", "4", "4"]
    # probe i reads the text after chunk i and runs beside chunk i + 1, which the chain keeps (as Dynasor does)
    assert result.main_tokens == 48 and result.probe_tokens == 15 and result.probe_input_tokens == 50
    assert result.saved_tokens == 100 - 48 - 15
    assert result.text == "x" * 48 + final_answer_block("4", thinking=False)
    assert result.text.endswith("\\boxed{4}\n\\]") and "</think>" not in result.text


@pytest.mark.parametrize(
    ("prompt", "closes"),
    [("q <think>\n", True), ("q <think>\n... </think>\n", False), ("q", False)],
)
def test_early_exit_closes_an_open_thinking_block(prompt, closes):
    result = run_cot(ScriptedBackend(["4", "4", "4"]), prompt, max_tokens=100, window=2, chunk=8)
    assert result.exited_early
    block = result.text[result.text.index("\n\n...") :]
    assert block.startswith("\n\n...</think>\n Oh, I have got") == closes
    assert block.endswith("**Final Answer:**\n\\[\n \\boxed{4}\n\\]")


def test_run_cot_inconsistent_probes_use_the_whole_budget():
    backend = ScriptedBackend(["1", "2", "1", "2", "", "2", "3", "3"])
    result = run_cot(backend, "q", max_tokens=64, window=2, chunk=8)
    assert (
        not result.exited_early and result.main_tokens == 64 and len(result.probe_answers) == 7
    )  # none after the last chunk
    assert result.saved_tokens == -result.probe_tokens


def test_run_sc_stops_on_certaindex_and_replay_matches():
    agreeing = ["5", "5", "5", "5", "6", "6", "6", "6"]
    adaptive = run_sc(ScriptedBackend(sample_answers=agreeing), "q", max_samples=8, step=4, threshold=0.8)
    assert (
        adaptive.stopped_early
        and adaptive.answers == ["5"] * 4
        and adaptive.certaindex == [pytest.approx(1.0)]
    )
    full = run_sc(ScriptedBackend(sample_answers=agreeing), "q", max_samples=8, step=4, threshold=None)
    assert not full.stopped_early and len(full.answers) == 8 and full.tokens == 2 * (10 + 11 + 12 + 13)
    assert replay(full, 4, 0.8).to_dict() == adaptive.to_dict()
    split = run_sc(
        ScriptedBackend(sample_answers=["1", "2", "1", "2", "3", "4", "5", "6"]), "q", max_samples=8, step=4
    )
    assert not split.stopped_early and len(split.answers) == 8 and split.answer == "1"


def test_calibrate_picks_cheapest_threshold_within_tolerance():
    easy = run_sc(ScriptedBackend(sample_answers=["5"] * 8), "q", max_samples=8, step=2, threshold=None)
    late = run_sc(
        ScriptedBackend(sample_answers=["1", "2", "3", "3", "3", "3", "3", "3"]),
        "q",
        max_samples=8,
        step=2,
        threshold=None,
    )
    best, points = calibrate([easy, late], ["5", "3"], step=2, thresholds=[0.0, 0.5, 0.9])
    assert points[0].threshold is None and points[0].accuracy == 1.0
    by_t = {p.threshold: p for p in points}
    assert by_t[0.0].accuracy == 0.5  # stopping after two samples gets "1" for the second problem
    assert best.accuracy == 1.0 and best.mean_tokens < points[0].mean_tokens and best.threshold in (0.5, 0.9)
    with pytest.raises(ValueError, match="one reference per run"):
        calibrate([easy], [], step=2, thresholds=[0.5])


def test_problem_file_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": "q", "answr": "3"}\n'
    )
    with pytest.raises(ValueError, match=r"p.jsonl:2: .*; to resolve, fix that line"):
        load_problems(path)
    path.write_text('{"id": "a", "question": "q", "answer": "A", "choices": ["only one"]}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: choices: .*2 to 10 options"):
        load_problems(path)
    assert arithmetic(5, seed=3) == arithmetic(5, seed=3) and arithmetic(5, seed=3) != arithmetic(5, seed=4)
    assert all(int(p.answer) >= 0 for p in arithmetic(50))
