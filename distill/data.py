"""Training data for distillation: load with ``datasets``, render chats, mask, pack.

* Sources: ``sharegpt`` (the embedded set), local .json/.jsonl/.parquet/.txt files, or hub dataset names.
* Conversations (ShareGPT ``from``/``value`` or OpenAI ``role``/``content``) are rendered with the model's chat
  template.  Assistant tokens are found from character spans: the text up to each assistant turn is the
  template applied to the earlier turns with ``add_generation_prompt``, and the template output of a prefix
  of the conversation is a prefix of the whole (checked, not assumed).  The loss mask is shifted so that
  position t counts when token t+1 is counted ("predicts an assistant token").
* Packing: samples are concatenated into rows of ``seq_len`` tokens with ``position_ids`` restarting at 0 for
  each sample; transformers turns such position ids into a block-diagonal causal mask, so a token never
  attends to another sample.  Padding is a segment of its own with loss 0, so rows need no attention mask.
"""

from __future__ import annotations

from pathlib import Path

import torch

from swiftkv.assets import HELDOUT_START, resolve_data_path, to_messages

from .recipe import DataSection, DataSource

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class DataError(ValueError):
    """A data problem (missing file, empty result) with a one-line message."""


def load_source(source: DataSource):
    """Raw records of one source as a ``datasets.Dataset``."""
    import datasets

    path = Path(resolve_data_path(source.path)) if source.path == "sharegpt" else Path(source.path)
    try:
        if path.suffix in _BUILDERS or path.exists():
            if not path.is_file():
                raise DataError(f"data file {path} not found; to resolve, check data.sources[].path")
            if path.suffix not in _BUILDERS:
                raise DataError(f"data file {path}: unsupported extension; use one of {', '.join(_BUILDERS)}")
            ds = datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(source.path, split=source.split)
    except DataError:
        raise
    except Exception as e:  # network, hub or parse failures from datasets
        raise DataError(f"could not load data source {source.path!r}: {str(e).splitlines()[0]}") from None
    if source.path == "sharegpt":  # the embedded set's train split only: the held-out part is for evaluation
        ds = ds.select(range(min(HELDOUT_START, len(ds))))
    if source.max_samples is not None:
        ds = ds.select(range(min(source.max_samples, len(ds))))
    return ds


def render_conversation(messages: list[dict], tokenizer, loss_on: str = "assistant") -> dict[str, list[int]]:
    """Token ids of a chat and a mask of the tokens the loss counts (before shifting)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        end = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(start) and text.startswith(end)):
            raise DataError("the chat template does not render prefixes of a conversation as prefixes")
        spans.append((len(start), len(end)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if loss_on == "all":
        counted = [1] * len(enc["input_ids"])
    else:
        counted = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return {"input_ids": enc["input_ids"], "counted": counted}


def _instruction(record: dict) -> list[dict]:
    """Instruction/response records (OpenOrca, Alpaca style) as turns."""
    prompt = next((record[k] for k in ("question", "instruction", "prompt") if record.get(k)), None)
    answer = next((record[k] for k in ("response", "output", "answer") if record.get(k)), None)
    if prompt is None or answer is None:
        return []
    system = [{"role": "system", "content": record["system_prompt"]}] if record.get("system_prompt") else []
    return [*system, {"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _tokenize(record: dict, tokenizer, source: DataSource, loss_on: str) -> dict[str, list[int]]:
    if source.format == "text":
        ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "counted": [1] * len(ids)}
    turns = (
        record.get("conversations")
        or record.get("messages")
        or record.get("conversation")
        or _instruction(record)
    )
    messages = to_messages(turns)
    if not any(m["role"] == "assistant" for m in messages):
        return {"input_ids": [], "counted": []}
    return render_conversation(messages, tokenizer, loss_on)


def pack(samples, seq_len: int, pad_id: int, packing: bool = True) -> dict[str, torch.Tensor]:
    """Rows of ``seq_len`` tokens: ``input_ids``, ``position_ids`` (restarting per sample), ``loss_mask``."""
    rows: list[tuple[list[int], list[int], list[int]]] = []
    ids: list[int] = []
    pos: list[int] = []
    mask: list[int] = []

    def flush():
        fill = seq_len - len(ids)
        rows.append((ids + [pad_id] * fill, pos + list(range(fill)), mask + [0] * fill))

    for sample in samples:
        s_ids, counted = sample["input_ids"][:seq_len], sample["counted"][:seq_len]
        if not any(counted[1:]):  # e.g. a long prompt whose reply starts past seq_len: nothing to learn
            continue
        if ids and (not packing or len(ids) + len(s_ids) > seq_len):
            flush()
            ids, pos, mask = [], [], []
        ids += s_ids
        pos += list(range(len(s_ids)))
        mask += counted[1:] + [0]  # position t predicts token t+1
    if ids:
        flush()
    if not rows:
        return {
            k: torch.empty(0, seq_len, dtype=torch.long) for k in ("input_ids", "position_ids", "loss_mask")
        }
    cols = list(zip(*rows, strict=True))
    return {k: torch.tensor(c) for k, c in zip(("input_ids", "position_ids", "loss_mask"), cols, strict=True)}


def build_datasets(data: DataSection, tokenizer, max_positions: int | None = None):
    """Packed train and held-out tensors (dicts of [rows, seq_len] tensors) for a recipe's data section."""
    import datasets

    if max_positions is not None and data.seq_len > max_positions:
        raise DataError(
            f"data.seq_len={data.seq_len} exceeds the model's max_position_embeddings={max_positions}"
        )
    parts = []
    for source in data.sources:
        raw = load_source(source)
        tokenized = raw.map(
            _tokenize,
            fn_kwargs={"tokenizer": tokenizer, "source": source, "loss_on": data.loss_on},
            remove_columns=raw.column_names,
            desc=f"tokenizing {source.path}",
        )
        parts.append(
            tokenized.filter(lambda s: sum(s["counted"][1:]) > 0, desc="dropping samples without loss tokens")
        )
    if len(parts) == 1:
        mixed = parts[0]
    else:
        weights = [s.weight for s in data.sources]
        mixed = datasets.interleave_datasets(
            parts,
            probabilities=[w / sum(weights) for w in weights],
            seed=data.seed,
            stopping_strategy="first_exhausted",
        )
    if len(mixed) == 0:
        raise DataError("the dataset is empty after filtering (no sample has a token the loss counts)")
    mixed = mixed.shuffle(seed=data.seed)
    n_eval = int(round(len(mixed) * data.holdout))
    if data.holdout > 0 and n_eval == 0 and len(mixed) > 1:
        n_eval = 1
    eval_part, train_part = mixed.select(range(n_eval)), mixed.select(range(n_eval, len(mixed)))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pack(train_part, data.seq_len, pad_id, data.packing), pack(
        eval_part, data.seq_len, pad_id, data.packing
    )
