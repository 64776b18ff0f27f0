"""scripts/bench_rank_aging.py on a synthetic ranker: the table's arms, the chosen constant, bad input in one line."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_rank_aging as bra  # noqa: E402


def test_sweep_on_a_synthetic_ranker(tmp_path, capsys):
    from helpers.ranking import save_word_tokenizer, write_sharegpt

    from eval.serving.ranking.labels import sharegpt_lengths
    from eval.serving.ranking.train import TrainConfig, train_ranker

    tok = save_word_tokenizer(tmp_path / "tok")
    sharegpt_lengths(tok, tmp_path / "train", data=write_sharegpt(tmp_path / "a.jsonl"), records="all")
    sharegpt_lengths(tok, tmp_path / "test", data=write_sharegpt(tmp_path / "b.jsonl", seed=1), records="all")
    ranker = train_ranker(
        tmp_path / "train", tmp_path / "r", TrainConfig(kind="ngram", ngram_bits=12, held_out=0)
    )
    out = tmp_path / "aging.json"
    argv = [str(ranker), str(tmp_path / "test"), "--requests", "120", "--seeds", "0,1", "--agings", "10,1e9",
            "--bound", "100", "--out", str(out)]  # fmt: skip
    assert bra.main(argv) == 0
    result = json.loads(out.read_text())
    from eval.serving.ranking.simulator import choose_aging

    chosen = result["meta"]["chosen_aging_s"]
    assert (
        chosen == choose_aging(result["rows"], 100) and chosen in (10, 1e9) and len(result["rows"]) == 2 * 4
    )
    assert [line.split(" | ")[0] for line in result["table"][2:6]] == [
        "| fcfs", "| ranker, no aging", "| ranker, aging 10 s", "| ranker, aging 1e+09 s"]  # fmt: skip
    assert f"chosen aging_s: {chosen:g}" in capsys.readouterr().out
    assert bra.main([str(ranker), str(tmp_path / "none"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and len(err.splitlines()) == 1
