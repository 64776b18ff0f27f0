"""scripts/bench_kvcompress_pareto.py: the Pareto front, the verdict against the 9x / 3% target, and the three
outputs from a table of rows, the bootstrap interval and the records a rerun resumes from (the measurement
itself is kvcompress.evaluate.measure_sequence, tested with the cache)."""

from __future__ import annotations

import json
import math
import runpy
import subprocess
import sys

from helpers import ROOT

SCRIPT = runpy.run_path(str(ROOT / "scripts" / "bench_kvcompress_pareto.py"), run_name="script_under_test")


def rows(**points: tuple[float, float]) -> dict[str, dict]:
    return {
        m: {"ratio_vs_fp16": x, "ppl_increase_pct": y, "kl": 0.0, "top1_agree": 1.0}
        for m, (x, y) in points.items()
    }


def test_front_keeps_only_undominated_methods():
    table = rows(full=(1, 0), a=(5, 1), b=(8, 2), c=(7, 4), d=(10, 30), e=(8, 2.5))
    assert SCRIPT["pareto_front"](table) == {"full", "a", "b", "d"}


def test_verdict_names_the_best_method_or_both_sides_of_the_shortfall():
    assert SCRIPT["verdict"](rows(full=(1, 0), a=(9.5, 2.9), b=(10, 2))).startswith("target met: b is 10.00x")
    short = SCRIPT["verdict"](rows(full=(1, 0), a=(8.4, 2.5), b=(9.6, 7.1), c=(6, 1)))
    assert short == (
        "target not met: within +3% perplexity the smallest is a at 8.40x; at ≥ 9x the best is b at +7.10%"
    )


def test_markdown_and_plot_are_written(tmp_path):
    table = rows(full=(1, 0), a=(8.4, 2.5), b=(9.6, 7.1))
    front = SCRIPT["pareto_front"](table)
    text = SCRIPT["markdown"](table, {"full": "", "a": "tiers a", "b": "tiers b"}, front, "header", "verdict")
    assert text.splitlines()[4].startswith("| `full` |") and "| `b` | tiers b | 9.60× | +7.10% [" in text
    SCRIPT["plot"](table, front, "title", tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_bootstrap_interval_is_paired_over_sequences():
    """A method 1% worse on every token of every sequence gets [+1%, +1%] however different the sequences'
    own perplexities are (pairing removes them); a mixed one gets an interval around its point estimate."""
    seqs = [
        {"full": {"nll": 10.0 * k, "n": 10}, "a": {"nll": 10.0 * k + 10 * math.log(1.01), "n": 10}}
        for k in (1, 3, 5)
    ]
    lo, hi = SCRIPT["bootstrap_interval"](seqs, "a", "full", 200)
    assert math.isclose(lo, 1.0, abs_tol=1e-6) and math.isclose(hi, 1.0, abs_tol=1e-6)
    for r, gap in zip(seqs, (-0.5, 0.1, 1.0), strict=True):
        r["b"] = {"nll": r["full"]["nll"] + gap, "n": 10}
    lo, hi = SCRIPT["bootstrap_interval"](seqs, "b", "full", 500)
    point = 100 * (math.exp(0.6 / 30) - 1)
    assert (
        lo < point < hi
        and lo >= 100 * (math.exp(-0.05) - 1) - 1e-9
        and hi <= 100 * (math.exp(0.1) - 1) + 1e-9
    )


def test_methods_with_a_variant_are_compared_with_it_paired():
    """``versus_variants`` pairs ``X`` with ``X:pca`` and ``X:uniform`` only: the perplexity ratio of the two
    rows and the bootstrap interval of ``X`` over the variant on the same sequences."""
    seqs = [
        {
            "full": {"nll": 10.0 * k, "n": 10},
            "a": {"nll": 10.0 * k + 0.1, "n": 10},
            "a:pca": {"nll": 10.0 * k + 0.1 + 10 * math.log(1.02), "n": 10},
            "b": {"nll": 10.0 * k, "n": 10},
            "b:uniform": {"nll": 10.0 * k + 10 * math.log(1.05), "n": 10},
            "c:other": {"nll": 10.0 * k, "n": 10},
        }
        for k in (1, 2)
    ]
    table = {
        m: {"ppl": math.exp(sum(r[m]["nll"] for r in seqs) / sum(r[m]["n"] for r in seqs))} for m in seqs[0]
    }
    got = SCRIPT["versus_variants"](table, seqs, 100)
    assert sorted(got) == ["a:pca", "b:uniform"]
    for variant, ratio in (("a:pca", 1.02), ("b:uniform", 1.05)):
        assert math.isclose(got[variant]["ppl_change_pct"], 100 * (1 / ratio - 1), rel_tol=1e-9)
        lo, hi = got[variant]["ci"]
        assert math.isclose(lo, 100 * (1 / ratio - 1), abs_tol=1e-6) and math.isclose(hi, lo, abs_tol=1e-6)


def test_records_are_read_back_per_set_and_sequence(tmp_path):
    path = tmp_path / "p.records.jsonl"
    lines = [
        {"set": "sharegpt", "seq": 0, "method": "full", "result": {"nll": 1.0}},
        {"set": "sharegpt", "seq": 0, "method": "a", "result": {"nll": 2.0}},
        {"set": "stdlib", "seq": 0, "method": "full", "result": {"nll": 3.0}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = SCRIPT["read_records"](path)
    assert records == {
        ("sharegpt", 0): {"full": {"nll": 1.0}, "a": {"nll": 2.0}},
        ("stdlib", 0): {"full": {"nll": 3.0}},
    }
    assert SCRIPT["read_records"](tmp_path / "absent.jsonl") == {}


def test_a_bad_method_is_refused_before_calibrating(tmp_path):
    """--methods is checked as the command line is read: a spec with a flag the method ignores stops the run in
    one line before the factors folder is touched (calibration takes minutes)."""
    factors = tmp_path / "factors"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_kvcompress_pareto.py"), str(tmp_path), "--factors",
         str(factors), "--methods", "full,kivi:2:pca", "--out", str(tmp_path / "p")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "'kivi:2:pca'" in run.stderr and "to resolve" in run.stderr and not factors.exists()
