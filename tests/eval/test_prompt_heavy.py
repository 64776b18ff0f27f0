"""The prompt-heavy measurements (``eval.prompt_heavy``) against what a server computes: retrieval scored in one
teacher-forced pass equals greedy generation through the cache, and the interval arithmetic."""

from __future__ import annotations

import numpy as np
import torch
from helpers.models import tiny_base, to_swiftkv

from eval.prompt_heavy import answer_correct, score_samples, summarize


def _student(l: int, window: int, scale: float):
    model = to_swiftkv(tiny_base("llama"), l=l)
    with torch.no_grad():  # far enough from the teacher that some greedy answers differ
        for name in model.swiftkv_parameter_names():
            model.get_parameter(name).add_(scale * torch.randn_like(model.get_parameter(name)))
    model.config.exact_kv_window = window
    return model.eval()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def test_answer_correct_is_greedy_generation_through_the_cache():
    """For the teacher's own greedy answer, the teacher is right; each student (two windows, two depths) is right
    exactly when its own cached greedy generation emits the same tokens; both outcomes occur."""
    teacher = tiny_base("llama").eval()
    students = {"w2": _student(2, 2, 0.3), "w0": _student(4, 0, 0.3), "w5": _student(3, 5, 0.05)}
    outcomes = set()
    for seed in range(8):
        prompt = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
        answer = _greedy(teacher, prompt, 4)
        got = answer_correct(teacher, students, prompt, answer)
        assert got["teacher"]
        for name, student in students.items():
            assert got[name] == (_greedy(student, prompt, 4) == answer), (seed, name)
            outcomes.add(got[name])
    assert outcomes == {True, False}


def test_score_samples_matches_the_per_reply_scoring():
    """score_samples (one teacher pass, rows-only students) gives served_sums' numbers for the same reply."""
    from distill.served import served_sums

    teacher = tiny_base("llama").eval()
    student = _student(2, 3, 0.05)
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    sample = {"input_ids": ids, "counted": [0] * 22 + [1] * 8}
    got = score_samples(teacher, {"s": student}, [sample], 0, "test")["s"][0]
    want = served_sums(teacher, {"s": (student, {"served": 3})}, [sample], 30, 0)["s"]["served"]["reply"].sum(
        0
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def test_summarize_weights_tokens_and_brackets_the_mean():
    sums = np.array([[1.0, 4, 10, 20, 19], [3.0, 2, 10, 22, 20], [0.0, 0, 0, 0, 0]])
    s = summarize(sums)
    assert s["samples"] == 3 and s["tokens"] == 20
    assert s["kl"] == 0.2 and s["top1_agreement"] == 0.3
    assert np.isclose(s["ppl_ratio"], np.exp(3 / 20))
    lo, hi = s["kl_ci95"]
    assert 0.0 <= lo <= 0.2 <= hi <= 0.3
    same = summarize(np.array([[2.0, 1, 10, 5, 5]] * 4))
    assert same["kl_ci95"] == [0.2, 0.2]
    assert summarize(np.zeros((0, 5))) == {"samples": 0, "tokens": 0}
