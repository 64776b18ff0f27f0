"""``swiftkv gpu-check-vllm`` (``eval.serving.vllm.gpu_check``): the vLLM plugin's GPU check, its row logic without
vLLM (the plan, the verdict, vLLM's capture sizes and scheduler in miniature, the comparisons) and its rows on
vLLM's CPU build; ``swiftkv gpu-check``, which runs it: tests/eval/test_gpu_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT

import eval.serving.vllm.gpu_check as check
import eval.serving.vllm.gpu_check_reference as reference_check


def test_vllm_rows_run_the_control_first_then_in_order_of_value():
    """The control sets every tolerance, so it runs first: a budget that cuts the run short still judges the rows
    before the cut; each row names the model runner it checks."""
    names = [r.name for r in check.plan()]
    assert names[:4] == ["control", "swiftkv50", "swiftkv50_g2", "swiftkv50_exact"]
    assert len(set(names)) == len(names)
    for needed in ("swiftkv50-ngram", "swiftkv50_g2-fp8", "swiftkv50-preempt", "qwen2-swiftkv50",
                   "qwen3-swiftkv50_g2", "swiftkv50-v1", "swiftkv50-ngram-v1"):  # fmt: skip
        assert needed in names
    rows = {r.name: r for r in check.plan()}
    assert rows["swiftkv50-v1"].env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and rows["swiftkv50"].env == {}
    assert {r.name for r in check.plan() if r.runner == "V1"} == {
        r.name for r in check.plan() if r.env == check.V1
    }
    assert {r.runner for r in check.plan()} == {"V1", "V2"}
    assert not rows["swiftkv50-fp8"].reference and rows["swiftkv50-ngram"].reference
    # the default budget holds every row's estimate with half as much again to spare
    assert 1.5 * sum(r.estimate_s for r in check.plan()) <= 2400


def ran(name: str, engines: float = 0.0, reference: float | None = 0.0, **extra) -> dict:
    row = {"name": name, "status": "ran", "engines": {"max_abs": engines, "divergences": 0, "tie_gap": 0.0},
           "prefix_hits": 64, "preemptions": 0}  # fmt: skip
    if reference is not None:
        row["reference"] = {"max_abs": reference, "tie_gap": 0.0}
    return {**row, **extra}


def test_vllm_verdict_uses_the_controls_spread_and_is_never_ok_with_a_row_not_run():
    control = ran("control", engines=0.01, reference=0.03)
    status, tol = check.verdict([ran("a", 0.025, 0.08), dict(control)])
    assert status == "ok" and tol == {"engines": pytest.approx(0.03), "reference": pytest.approx(0.09)}
    rows = [ran("a", 0.04, 0.08), dict(control)]
    assert check.verdict(rows)[0] == "FAIL" and "against its twin engine: 0.0400" in rows[0]["why"][0]
    assert check.verdict([ran("a"), {"name": "b", "status": "not run"}, dict(control)])[0] == "incomplete"
    assert check.verdict([ran("a")]) == ("incomplete", None)  # no control: nothing judged
    assert check.verdict([ran("a", 9.0), ran("control", 0.0, 0.0)])[0] == "FAIL"  # the floor, not 0
    assert check.verdict([ran("a", prefix_hits=0), dict(control)])[0] == "FAIL"
    preempt = ran("swiftkv50-preempt", prefix_hits=0)
    assert check.verdict([preempt, dict(control)])[0] == "FAIL" and preempt["why"] == [
        "no request was preempted"
    ]
    failed = {"name": "a", "status": "FAIL", "why": ["an engine failed: ..."]}
    assert check.verdict([failed, {"name": "control", "status": "not run"}])[0] == "FAIL"


def test_vllm_fp8_rows_are_labelled_consistency_only_and_rows_fail_on_another_runner():
    """A row without the transformers reference (the FP8 KV cache: transformers keeps K/V unquantized) passes on
    its twin alone, which runs the same FP8 code: the verdict names it "consistency only".  A row that ran on
    another model runner than it names fails (it did not check what it claims); a CPU run expects none."""
    control = ran("control", engines=0.01, reference=0.03)
    fp8 = ran("swiftkv50-fp8", reference=None)
    rows = [dict(control), ran("swiftkv50"), fp8]
    assert check.verdict(rows)[0] == "ok" and check.consistency_only(rows) == ["swiftkv50-fp8"]
    assert [r["judged"] for r in rows] == ["against transformers fp32 and the twin"] * 2 + [
        "consistency only"
    ]
    assert check.consistency_only([ran("swiftkv50-fp8", reference=None)]) == []  # not judged: not labelled
    fell_back = ran("swiftkv50", runner="V1", runner_expected="V2")
    assert check.verdict([dict(control), fell_back])[0] == "FAIL"
    assert fell_back["why"] == [
        "the engine ran on the V1 model runner, not V2 (vLLM's log says why it fell back)"
    ]
    assert check.verdict([dict(control), ran("swiftkv50-v1", runner="V1", runner_expected="V1")])[0] == "ok"
    assert check.verdict([dict(control), ran("cpu", runner="V1", runner_expected=None)])[0] == "ok"


def test_vllm_runner_version_from_the_runner_classes_modules():
    """V1 and V2 by where vLLM 0.32/0.33 define their runners (GPU and CPU builds), unknown otherwise."""
    v1 = ["vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.lora_model_runner_mixin", "builtins"]
    assert check.runner_version(v1) == "V1"
    assert (
        check.runner_version(["vllm.v1.worker.cpu_model_runner", *v1]) == "V1"
    )  # CPUModelRunner(GPUModelRunner)
    assert check.runner_version(["vllm.v1.worker.gpu.model_runner", "builtins"]) == "V2"
    assert (
        check.runner_version(["vllm.v1.worker.cpu.model_runner", "vllm.v1.worker.gpu.model_runner"]) == "V2"
    )
    assert check.runner_version(["vllm.v2.runner", "builtins"]) == "unknown (vllm.v2.runner)"
    worker = SimpleNamespace(model_runner=SimpleNamespace())
    assert check.runner_modules(worker) == ["types", "builtins"]
    attention = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))
    model = SimpleNamespace(modules=lambda: [SimpleNamespace(), attention])
    assert check.attention_backend(model) == "FLASH_ATTN"


def test_vllm_engines_start_in_a_clean_environment():
    """Only the allowlist passes from the user's shell (paths, caches, the device, vLLM's CPU-build settings):
    a VLLM_* or SWIFTKV_* left there cannot change what a row checks; the row's own env comes last."""
    shell = {
        "PATH": "/bin", "HOME": "/h", "CUDA_VISIBLE_DEVICES": "0", "HF_HOME": "/hf", "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_ATTENTION_BACKEND": "FLASHINFER", "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_BATCH_INVARIANT": "1",
        "SWIFTKV_FAST_PREFILL": "0", "PYTHONPATH": "/elsewhere", "HF_HUB_OFFLINE": "0", "AWS_SECRET": "x",
        "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    env = check.engine_environment(shell, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert env == {
        "PATH": "/bin", "HOME": "/h", "CUDA_VISIBLE_DEVICES": "0", "HF_HOME": "/hf", "VLLM_CPU_KVCACHE_SPACE": "4",
        "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }  # fmt: skip
    assert "VLLM_USE_V2_MODEL_RUNNER" not in check.engine_environment(shell, {})


# vLLM 0.32's own VllmConfig._set_cudagraph_sizes and CompilationConfig.adjust_cudagraph_sizes_for_spec_decode on
# these (max_num_seqs, max_num_batched_tokens, drafts): [V2's sizes, V1's] (test_vllm_capture_sizes_are_vllms
# recomputes them in the vLLM venv)
VLLM_CAPTURE_SIZES = {
    (32, 2048, 0): [[1, 2, 4, *range(8, 65, 8)]] * 2,
    (32, 2048, 3): [[1, 2, 4, *range(8, 257, 8)], [4, *range(8, 257, 8)]],
    (4, 32, 0): [[1, 2, 4, 8]] * 2,
    (300, 8192, 0): [[1, 2, 4, *range(8, 256, 8), 256, 272, 288, 300, *range(304, 513, 16)]] * 2,
    (8, 64, 2): [[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48], [3, 6, 9, 12, 18, 24, 33, 42, 48]],
}


def test_vllm_capture_sizes_follow_vllms_rule():
    for (seqs, tokens, drafts), (v2, v1) in VLLM_CAPTURE_SIZES.items():
        assert check.capture_sizes(seqs, tokens, drafts) == v2
        assert check.capture_sizes(seqs, tokens, drafts, v1=True) == v1


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_capture_sizes_are_vllms(vllm_python):
    """The table above is what the installed vLLM computes (its own functions on the config fields they read)."""
    script = textwrap.dedent(
        """
        import json
        from types import SimpleNamespace
        from vllm.config import CompilationConfig, VllmConfig
        from vllm.config.compilation import CUDAGraphMode

        out = {}
        for seqs, tokens, drafts in json.loads(input()):
            compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
            spec = SimpleNamespace(num_speculative_tokens=drafts, uses_dynamic_speculative_decoding=lambda: False)
            config = SimpleNamespace(
                model_config=SimpleNamespace(enforce_eager=False), compilation_config=compilation,
                uniform_decode_query_len=1 + drafts, num_speculative_tokens=drafts, performance_mode="balanced",
                scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens),
                speculative_config=spec if drafts else None,
            )
            VllmConfig._set_cudagraph_sizes(config)
            v2 = list(compilation.cudagraph_capture_sizes)
            compilation.adjust_cudagraph_sizes_for_spec_decode(1 + drafts)
            out[f"{seqs},{tokens},{drafts}"] = [v2, list(compilation.cudagraph_capture_sizes)]
        print(json.dumps(out))
        """
    )
    cases = json.dumps([list(k) for k in VLLM_CAPTURE_SIZES])
    proc = subprocess.run(
        [str(vllm_python), "-c", script], input=cases, capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {",".join(map(str, k)): [list(v) for v in sizes] for k, sizes in VLLM_CAPTURE_SIZES.items()}


def test_vllm_steps_follow_the_scheduler():
    """Requests submitted together: one prefill step while they fit the budget and max_num_seqs, then decode
    steps; a prompt past the budget is chunked beside the running decodes; prefix hits shorten the prefill."""
    assert check.schedule([5, 12], [0, 0], 3, 32, 2048) == [[(5, True), (12, True)], [(1, False)] * 2,
                                                           [(1, False)] * 2]  # fmt: skip
    assert check.schedule([3000], [0], 2, 32, 2048) == [[(2048, True)], [(952, True)], [(1, False)]]
    assert check.schedule([8, 8, 8], [0, 0, 0], 2, 2, 2048) == [[(8, True), (8, True)], [(1, False)] * 2,
                                                                [(8, True)], [(1, False)]]  # fmt: skip
    assert check.schedule([40], [32], 1, 32, 2048) == [[(8, True)]]


def test_vllm_short_pass_makes_every_compiled_row_replay_piecewise_graphs_on_gathered_rows():
    """The workload's steps against vLLM's default capture sizes (``simulate_counter``): without the short pass
    every prefill step of a row without speculation is larger than its largest captured graph (64 tokens at
    max_num_seqs 32), so its decode stack runs without graphs, and decode steps replay FULL graphs the counter never
    sees: 11 of the 15 compiled SwiftKV rows would fail on a correct plugin.  The short pass's one prefill step (54
    tokens) fits, and each of those rows' counters sees a piecewise graph on gathered rows, at a captured size."""
    compiled = [r for r in check.plan() if check.graphs_expected(r, r.engine, cpu=False)]
    assert len(compiled) == 15 and "control" not in {r.name for r in compiled}
    before = {r.name for r in compiled if not check.simulate_counter(r, ("batch", "again", "long")).get(
        check.GATHERED_GRAPHS)}  # fmt: skip
    assert before == {r.name for r in compiled if "ngram" not in r.name} and len(before) == 11
    for row in compiled:
        assert check.simulate_counter(row, ("short",))[check.GATHERED_GRAPHS] == 1, row.name
        assert check.simulate_counter(row)[check.GATHERED_GRAPHS] >= 1, row.name
    assert check.PASSES[0] == "short"  # on a fresh engine: no prefix hit can shrink it
    sizes = check.capture_sizes(check.ENGINE["max_num_seqs"], check.ENGINE["max_num_batched_tokens"])
    step = check.schedule(list(check.SHORT), [0] * 4, check.MAX_TOKENS, 32, check.CHUNK)[0]
    assert sum(check.SHORT) == 54 <= sizes[-1] == 64 and len(step) == 4  # one step, padded to 56
    # the rows the decode stack runs, at captured sizes: 4 logits rows; with W = 8, 5 + 8 + 8 + 8 = 29 -> 32
    assert (
        check.counter_key(step, sizes, 32, 0, 0)
        == check.counter_key(step, sizes, 32, 0, 8)
        == "PIECEWISE gathered"
    )
    assert min(check.SHORT) < check.WINDOW < max(check.SHORT)
    # what the counter cannot see and what runs without graphs
    assert check.counter_key([(1, False)] * 12, sizes, 32, 0, 0) is None  # uniform decode: a FULL graph
    assert check.counter_key([(1330, True)], sizes, 32, 0, 0) == "NONE gathered"


def test_vllm_rows_stop_at_the_budget_by_their_estimates():
    now = [0.0]

    def serve(row):
        now[0] += 100.0
        return {"status": "ran"}

    rows = check.plan()[:4]
    out = check.run_rows(rows, serve, budget_s=250.0, clock=lambda: now[0])
    assert [r["status"] for r in out] == ["ran", "ran", "not run", "not run"]
    assert out[2]["why"] == ["time budget: 200 s + 90 s > 250 s"]


def test_vllm_comparisons_follow_greedy_prefixes_and_near_ties():

    def request(tokens, logprobs, top2):
        return {"tokens": tokens, "logprobs": logprobs, "top2": top2}

    a = request(
        [5, 6, 7], [-0.1, -0.2, -0.3], [[[5, -0.1], [9, -3]], [[6, -0.2], [8, -0.21]], [[7, -0.3], [1, -4]]]
    )
    b = request(
        [5, 8, 2], [-0.12, -0.19, -1.0], [[[5, -0.12], [9, -3]], [[8, -0.19], [6, -0.2]], [[2, -1], [3, -2]]]
    )
    diff = check.engine_diff([a], [b])
    # tokens 0 compare; at 1 they diverge on a near tie (0.01 in both engines); nothing after is compared
    assert diff["divergences"] == 1 and diff["max_abs"] == pytest.approx(0.02)
    assert diff["tie_gap"] == pytest.approx(0.01)
    c = request(
        [5, 4, 2], [-0.1, -0.5, -1.0], [[[5, -0.1], [9, -3]], [[4, -0.5], [3, -0.6]], [[2, -1], [3, -2]]]
    )
    assert check.engine_diff([a], [c])["tie_gap"] == float("inf")  # 4 is not in a's top 2: no tie
    ref = check.reference_diff([a], [{"logprobs": [-0.1, -0.25, -0.3], "gaps": [0.0, 0.02, 0.0]}])
    assert ref == {"max_abs": pytest.approx(0.05), "tie_gap": pytest.approx(0.02)}


def test_without_vllm_it_refuses_in_one_line_before_any_work(tmp_path, capsys):
    """This test environment has no vLLM (the serving environment is another venv): one line, exit 2, nothing
    written."""
    out = tmp_path / "check.json"
    assert check.main(["--cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: vLLM is not installed in this environment (to resolve, ")
        and err.count("\n") == 1
    )
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_check_runs_its_rows_on_the_cpu_build(vllm_python, tmp_path):
    """The rows' own code on vLLM's CPU build (fp32, eager): an exact-K/V row and the control pass with the
    transformers path's log-probabilities, prefix hits in the second pass and the long prompt chunked; a chosen
    subset is at best incomplete; without --cpu on a machine without a GPU it refuses in one line, and so it does
    when the reference's interpreter has vLLM's older transformers."""
    from eval.serving.vllm.cpu import cpu_environment

    env = {**os.environ, **cpu_environment(tmp_path)}
    out = tmp_path / "check.json"
    cmd = [
        vllm_python,
        "-m",
        check.MODULE,
        "--cpu",
        "--rows",
        "swiftkv50_exact,control",
        "--reference-python",
        sys.executable,
        "--out",
        str(out),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    assert result.returncode == 3, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert report["verdict"] == "incomplete" and list(rows) == ["control", "swiftkv50_exact"]
    for row in rows.values():
        assert row["status"] == "ok", row.get("why")
        assert (row["runner"], row["attention_backend"]) == ("V1", "CPU_ATTN")  # no Triton on CPU: V1
        assert row["prefix_hits"] > 0 and row["reference"]["max_abs"] < 1e-3  # fp32 against fp32
    assert rows["swiftkv50_exact"]["twin"] == {"enforce_eager": True}  # exact K/V keep fast prefill on
    assert report["tolerances"]["engines"] == 0.02  # fp32 engines agree: the floor
    assert "verdict: incomplete" in result.stdout
    if not torch.cuda.is_available():
        refused = subprocess.run(
            [vllm_python, "-m", check.MODULE], cwd=ROOT, capture_output=True, text=True, env=env
        )
        assert refused.returncode == 4 and refused.stderr.startswith("no GPU: no CUDA device is visible")
    # vLLM's own transformers is older than this package's: the reference there is refused before any work
    stale = subprocess.run(
        [vllm_python, "-m", check.MODULE, "--cpu", "--reference-python", str(vllm_python)],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert stale.returncode == 2 and "this package needs" in stale.stderr and stale.stderr.count("\n") == 1


def fake_engine(calls: dict[str, int]):
    """``run_engine`` without vLLM: every request one greedy token, the second pass all cached, and the decode
    stack's calls per CUDA-graph mode as given; records the engines it was asked for."""
    asked = []

    def run_engine(model, engine, env, tmp, timeout_s, long=True):
        asked.append(engine)
        request = {"tokens": [5], "logprobs": [-0.1], "top2": [[[5, -0.1], [6, -2.0]]], "cached": 16}
        passes = {"short": [request] * 4, "batch": [request] * 12, "again": [request] * 12,
                  "long": [request] if long else []}  # fmt: skip
        return {"passes": passes, "decode_stack_calls": dict(calls), "preemptions": 0, "wall_s": 1.0,
                "runner": "V2", "attention_backend": "FLASH_ATTN"}  # fmt: skip

    return run_engine, asked


def test_references_of_every_row_run_in_one_process_that_survives_a_failed_row(
    tiny_llama_dir, monkeypatch, tmp_path
):
    """Each row's transformers reference is a job for one child process: its answers equal ``reference_logprobs``
    run here; a job that fails answers its error and the same process serves the next; a job past its timeout
    ends the process and the next job starts a fresh one; ``close`` ends the child."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    requests = [([1, 5, 9, 2], [7, 3]), ([4] * 10, [8])]
    expected = reference_check.reference_logprobs(tiny_llama_dir, requests, check.CHUNK)

    def answers(result: dict) -> list[dict]:
        assert "error" not in result, result["error"]
        return [{k: pytest.approx(v, rel=1e-6, abs=1e-7) for k, v in r.items()} for r in result["requests"]]

    reference = reference_check.ReferenceProcess(sys.executable, tmp_path, check.CHUNK)
    try:
        assert answers(reference.run(tiny_llama_dir, requests, 300)) == expected
        child = reference.process.pid
        failed = reference.run(tmp_path / "no-such-model", requests, 300)
        assert "no-such-model" in failed["error"] and reference.process.pid == child
        assert answers(reference.run(tiny_llama_dir, requests[1:], 300)) == expected[1:]
        assert reference.process.pid == child
        assert reference.run(tiny_llama_dir, requests, 0.001) == {"error": "no result within 0 s"}
        assert reference.process is None
        assert answers(reference.run(tiny_llama_dir, requests, 300)) == expected
        process = reference.process
        assert process.pid != child
    finally:
        reference.close()
    assert process.returncode == 0 and reference.process is None


def test_vllm_compiled_swiftkv_rows_fail_without_graphs_replayed_on_gathered_rows(monkeypatch, tmp_path):
    """A SwiftKV row whose compiled fast-prefill engine never ran its decode stack on gathered rows under a captured
    piecewise graph fails (graphs on gathered rows are the speed SwiftKV is served for); the control (vLLM's own
    Llama, no decode stack) and a CPU run (no graphs at all) are not asked for them."""
    rows = {r.name: r for r in check.plan()}
    n = sum(map(len, check.workload(check.TINY["vocab_size"]).values()))
    reference = SimpleNamespace(run=lambda *a: {"requests": [{"logprobs": [-0.1], "gaps": [0.0]}] * n})

    def served(name: str, calls: dict[str, int], cpu: bool = False) -> tuple[dict, list[dict]]:
        run_engine, asked = fake_engine(calls)
        monkeypatch.setattr(check, "run_engine", run_engine)
        return check.served_row(rows[name], {rows[name].model: tmp_path}, tmp_path, cpu, 60, reference), asked

    control, _ = served("control", {})
    no_graphs, asked = served("swiftkv50", {"NONE gathered": 40, "PIECEWISE": 3})
    assert asked[0] == {} and asked[1] == check.FAST_PREFILL_OFF  # the compiled engine, then its eager twin
    graphs, _ = served("swiftkv50_exact-fp8", {"PIECEWISE gathered": 30, "NONE gathered": 10})
    on_cpu, _ = served("swiftkv50", {"NONE gathered": 40}, cpu=True)
    assert [r["graphs_expected"] for r in (control, no_graphs, graphs, on_cpu)] == [False, True, True, False]
    assert (graphs["runner"], graphs["attention_backend"], graphs["runner_expected"]) == (
        "V2",
        "FLASH_ATTN",
        "V2",
    )
    assert on_cpu["runner_expected"] is None  # vLLM's CPU build runs V1 whatever the row names
    results = [{"name": name, **r} for name, r in
               (("swiftkv50", no_graphs), ("swiftkv50_exact-fp8", graphs), ("cpu", on_cpu), ("control", control))]  # fmt: skip
    assert check.verdict(results)[0] == "FAIL"
    assert [r["status"] for r in results] == ["FAIL", "ok", "ok", "ok"]
    assert results[0]["why"] == [
        "the decode stack never replayed a piecewise CUDA graph on gathered rows (its calls: NONE gathered 40, "
        "PIECEWISE 3)"
    ]


def test_vllm_long_context_pass_is_at_least_4k_tokens_and_fits_the_engine():
    long = check.long_prompt(check.TINY["vocab_size"])
    assert len(long) >= 4096 and len(long) > check.CHUNK  # chunked prefill over more than one step
    drafts = check.NGRAM["num_speculative_tokens"]
    assert check.ENGINE["max_model_len"] >= len(long) + check.MAX_TOKENS + drafts
    assert check.TINY["max_position_embeddings"] >= check.ENGINE["max_model_len"]


def test_unknown_rows_are_refused_in_one_line_before_any_work(capsys):
    assert check.main(["--rows", "control,no-such-row", "--cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: unknown rows no-such-row (to resolve, pick from control, swiftkv50, ")
