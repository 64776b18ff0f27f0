"""lm-eval on SwiftKV checkpoints: the stock ``lm_eval`` command on a converted checkpoint scores what the
model's own logits say, and the harness's served model scores continuations as a server generates them."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eval.tasks import write_tasks
from swiftkv.convert import convert


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory, smollm2, sharegpt):
    return write_tasks(tmp_path_factory.mktemp("tasks"), n_docs=6)


def loglikelihood(model, tokenizer, context: str, continuation: str, max_length: int) -> float:
    """log P(continuation | context), computed here the way lm-eval's HF model defines it: the context's
    trailing spaces moved to the continuation, the pair encoded whole and split at the context's length, the
    last ``max_length`` tokens of context + continuation fed to the model."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    ids = (ctx + whole[len(ctx) :])[-(max_length + 1) :]
    n = len(whole) - len(ctx)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids[:-1]])).logits[0].float().log_softmax(-1)
    return logprobs[-n:].gather(-1, torch.tensor(ids[-n:])[:, None]).sum().item()


@pytest.mark.slow
@pytest.mark.smollm2
def test_stock_lm_eval_runs_a_converted_checkpoint(tiny_chat_model, tasks_dir, tmp_path):
    """The stock ``lm_eval`` command on a converted checkpoint (its own modeling code, trust_remote_code): every
    score it logs, and both tasks' metrics, equal the ones computed here from the same model's logits."""
    model_dir = convert(tiny_chat_model, tmp_path / "swift", num_key_value_layers=3)
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},trust_remote_code=True,max_length=256",
        "--include_path",
        str(tasks_dir),
        "--tasks",
        "sharegpt_mc,sharegpt_ppl",
        "--limit",
        "3",
        "--device",
        "cpu",
        "--output_path",
        str(out),
        "--log_samples",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mc = [json.loads(line) for line in (tasks_dir / "sharegpt_mc.jsonl").read_text().splitlines()[:3]]
    logged = [
        json.loads(line) for line in next(out.rglob("samples_sharegpt_mc_*.jsonl")).read_text().splitlines()
    ]
    correct = 0
    for doc, sample in zip(mc, sorted(logged, key=lambda r: r["doc_id"]), strict=True):
        context = f"User: {doc['prompt']}\nAssistant:"  # then lm-eval's target delimiter, a space
        ours = [loglikelihood(model, tokenizer, context, " " + c, 256) for c in doc["choices"]]
        theirs = [float(ll) for ll, _ in sample["filtered_resps"]]  # the samples file holds them as text
        assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-3)
        correct += max(range(4), key=ours.__getitem__) == doc["label"]
    assert results["sharegpt_mc"]["acc,none"] == pytest.approx(correct / 3)

    texts = [
        json.loads(line)["text"] for line in (tasks_dir / "sharegpt_ppl.jsonl").read_text().splitlines()[:3]
    ]
    total, words = 0.0, 0
    for text in texts:  # one rolling window each: the BOS, then every token of the text
        tokens = tokenizer.encode(text)
        assert len(tokens) <= 256
        with torch.no_grad():
            logprobs = model(torch.tensor([[tokenizer.bos_token_id, *tokens[:-1]]])).logits[0].log_softmax(-1)
        total += logprobs.gather(-1, torch.tensor(tokens)[:, None]).sum().item()
        words += len(re.split(r"\s+", text))
    assert results["sharegpt_ppl"]["word_perplexity,none"] == pytest.approx(
        math.exp(-total / words), rel=1e-4
    )


@pytest.mark.smollm2
def test_served_lm_eval_scores_continuations_as_generated_tokens(tiny_chat_model, tmp_path):
    """With exact K/V, the harness's lm-eval model scores each continuation as a server generates it: its
    log-likelihood equals a cached generation that prefills the context and feeds the continuation token by
    token, for every row of a padded, reordered batch; stock lm-eval (one forward, the input as one prompt)
    gives another number."""
    from eval.harness import ServedHFLM

    path = convert(tiny_chat_model, tmp_path / "exact", swiftkv_fraction=0.5)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "exact_kv_window": 3}))
    lm = ServedHFLM(
        pretrained=str(path), dtype="float32", backend="causal", max_length=64, batch_size=2, device="cpu"
    )
    torch.manual_seed(0)
    requests = [
        (torch.randint(5, 1000, (n,)).tolist(), torch.randint(5, 1000, (k,)).tolist())
        for n, k in ((9, 4), (20, 6), (5, 1), (12, 3))
    ]
    got = [ll for ll, _ in lm._loglikelihood_tokens([(("", ""), c, x) for c, x in requests])]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    served, whole = [], []
    with torch.no_grad():
        for context, continuation in requests:
            step = model(torch.tensor([context]), use_cache=True, logits_to_keep=1)
            total = 0.0
            for token in continuation:
                total += step.logits[0, -1].log_softmax(-1)[token].item()
                step = model(torch.tensor([[token]]), cache=step.cache, use_cache=True)
            served.append(total)
            ids = torch.tensor([context + continuation[:-1]])
            logprobs = model(ids, use_cache=False).logits[0, -len(continuation) :].log_softmax(-1)
            whole.append(logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum().item())
    assert got == pytest.approx(served, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(served, whole, strict=True)) > 1e-3


def word_tokenizer(vocab: int = 128):
    """A word-level tokenizer over the words t0 ... t{vocab - 1} (t0 padding, t1 end of text), no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t0")


def test_served_lm_scores_rolling_loglikelihood_as_a_prompt():
    """Document perplexity (loglikelihood_rolling) scores text nobody generated: the served model treats it as a
    prompt (the plain forward: each window's last W positions exact), as stock lm-eval does, in windows of a
    text longer than max_length; continuations are still scored as generated."""
    from helpers.models import tiny_base, to_swiftkv
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from eval.harness import ServedHFLM

    model = to_swiftkv(tiny_base("llama"), l=2)
    model.config.exact_kv_window = 3
    text = " ".join(f"t{i}" for i in torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(2)))
    requests = [
        Instance("loglikelihood_rolling", {}, (text,), 0),
        Instance("loglikelihood_rolling", {}, (text[:50],), 1),
    ]
    pairs = [Instance("loglikelihood", {}, ("t5 t6 t7 t8 t9", " t10 t11 t12"), 0)]
    scores = {}
    for name, cls in (("served", ServedHFLM), ("stock", HFLM)):
        lm = cls(pretrained=model, tokenizer=word_tokenizer(), max_length=16, batch_size=2, device="cpu")
        scores[name] = (lm.loglikelihood_rolling(requests), lm.loglikelihood(pairs)[0][0])
    assert scores["served"][0] == pytest.approx(scores["stock"][0], abs=1e-5)
    assert abs(scores["served"][1] - scores["stock"][1]) > 1e-4


@pytest.mark.smollm2
def test_task_index_reads_lm_evals_own_tasks_only_when_one_is_named(tasks_dir):
    """Our tasks resolve from their folder alone; naming one of lm-eval's own tasks beside them brings lm-eval's
    index back, so a user's ``arc_easy`` still resolves."""
    from eval.harness import task_manager

    ours = task_manager(["sharegpt_mc", "sharegpt_ppl"], tasks_dir)
    assert set(ours.all_tasks) == {"sharegpt_mc", "sharegpt_ppl"}
    both = task_manager(["sharegpt_mc", "arc_easy"], tasks_dir)
    assert {"sharegpt_mc", "arc_easy"} <= set(both.all_tasks)
