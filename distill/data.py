"""Training data for distillation: each source read by its real columns, rendered, masked and packed as
``datasets`` maps on Arrow, so that no process holds the token stream in Python lists.

* Sources: ``sharegpt`` (the embedded set, its train split only), local .json/.jsonl/.parquet/.txt files, or
  hub dataset names.  A source's layout (``LAYOUTS``: which columns hold the turns) is named in the recipe or
  detected from its columns.  Refused at once, before any tokenizing: a gated hub dataset without a Hugging
  Face token, an unknown layout (the message names the columns it saw), and a source whose first rows yield
  no trainable sample (AceMath's ``messages`` hold only the user turn: the reply is ``answer``).
* Conversations are rendered with the model's chat template.  Assistant tokens are found from character spans:
  the text up to each assistant turn is the template applied to the earlier turns with
  ``add_generation_prompt``, and the template output of a prefix of the conversation is a prefix of the whole
  (checked, not assumed).  The loss mask is shifted so that position t counts when token t+1 is counted.
* Tokenizing is one batched ``map`` per source with ``num_proc`` workers, written to the datasets cache; the
  training loop builds the data on the main process first, and the other ranks reach the same fingerprints
  and load the cached Arrow files instead of tokenizing again.
* Packing is a batched ``map`` too: within each batch of ``PACK_BATCH`` samples, samples are concatenated into
  rows of ``seq_len`` tokens with ``position_ids`` restarting at 0 for each sample (transformers turns them
  into a block-diagonal causal mask), padding being a segment of its own with loss 0.  A row does not continue
  across batches: at most one partly filled row more per batch than one pass over the whole stream.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from toolkit.assets import HELDOUT_START, resolve_data_path, to_messages

from .recipe import DataSection, DataSource

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}

# layout -> the columns it reads (detection tries them in this order: acemath before messages)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "sharegpt": ("conversations",),  # [{from, value}]
    "acemath": ("messages", "answer"),  # messages: the user turn(s); answer: the reply
    "messages": ("messages",),  # [{role, content}]
    "lmsys": ("conversation",),  # [{role, content}], next to conversation_id, model, turn, language, ...
    "openorca": ("question", "response"),  # and system_prompt, often empty
    "text": ("text",),  # plain text, every token counted
}
_OPTIONAL = {"openorca": ("system_prompt",)}
ROW_COLUMNS = ("input_ids", "position_ids", "loss_mask")
PROBE_ROWS = 256  # rows of each source rendered before anything is tokenized
PACK_BATCH = 1000  # samples per packing batch


class DataError(ValueError):
    """A data problem (missing file, unknown layout, empty source) with a one-line message."""


def _local_path(source: DataSource) -> Path | None:
    """The file of a local source (checked), or None for a hub dataset name."""
    path = Path(resolve_data_path(source.path)) if source.path == "sharegpt" else Path(source.path)
    if path.suffix not in _BUILDERS and not path.exists():
        return None
    if not path.is_file():
        raise DataError(f"data file {path} not found (to resolve, check data.sources[].path)")
    if path.suffix not in _BUILDERS:
        raise DataError(
            f"data file {path} has an unsupported extension (to resolve, use {', '.join(_BUILDERS)})"
        )
    return path


def check_source(source: DataSource) -> None:
    """The checks that need no data: a local file must exist; a gated hub dataset needs a token (a local copy of
    a gated source, its ``path`` overridden with a file, needs none)."""
    if _local_path(source) is None and source.gated:
        import huggingface_hub

        if huggingface_hub.get_token() is None:
            raise DataError(
                f"data source {source.path!r} is a gated hub dataset and no Hugging Face token is configured "
                f"(to resolve, accept its terms at https://huggingface.co/datasets/{source.path} and run "
                "`hf auth login` or set HF_TOKEN on every node)"
            )


def check_sources(data: DataSection) -> None:
    """``check_source`` for every source: cheap, so it can run before the model is converted or loaded."""
    for source in data.sources:
        check_source(source)


def load_source(source: DataSource, streaming: bool = False, cache_dir: str | None = None):
    """Raw records of one source: a ``datasets.Dataset`` (an ``IterableDataset`` when ``streaming``)."""
    import datasets

    path = _local_path(source)
    kwargs = {"streaming": streaming, "cache_dir": os.path.expanduser(cache_dir) if cache_dir else None}
    try:
        if path is not None:
            ds = datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train", **kwargs)
        else:
            ds = datasets.load_dataset(source.path, split=source.split, **kwargs)
    except Exception as e:  # network, hub, gating or parse failures from datasets
        raise DataError(
            f"could not load data source {source.path!r}: {(str(e).strip() or type(e).__name__).splitlines()[0]} "
            "(to resolve, check the name, split and network; a gated dataset needs a login and gated: true)"
        ) from None
    if source.path == "sharegpt":  # the embedded set's train split only: the held-out part is for evaluation
        ds = _head(ds, HELDOUT_START)
    if source.max_samples is not None:
        ds = _head(ds, source.max_samples)
    return ds


def _head(ds, n: int):
    """The first ``n`` records of a Dataset or an IterableDataset."""
    import datasets

    return ds.take(n) if isinstance(ds, datasets.IterableDataset) else ds.select(range(min(n, len(ds))))


def _layout_names() -> str:
    return ", ".join(f"{name} ({'+'.join(cols)})" for name, cols in LAYOUTS.items())


def resolve_layout(source: DataSource, columns: list[str]) -> str:
    """The layout of a source: the recipe's ``format`` (its columns checked) or the first that fits."""
    seen = ", ".join(columns) or "none"
    if source.format != "auto":
        needed = LAYOUTS[source.format]
        if not all(c in columns for c in needed):
            raise DataError(
                f"data source {source.path!r}: format {source.format} reads columns {', '.join(needed)} but the "
                f"source has {seen} (to resolve, set data.sources[].format to its layout: {_layout_names()})"
            )
        return source.format
    for name, needed in LAYOUTS.items():
        if all(c in columns for c in needed):
            return name
    raise DataError(
        f"data source {source.path!r}: unknown layout, columns {seen} (to resolve, convert it to one of "
        f"{_layout_names()})"
    )


def _turns(layout: str, record: dict) -> list[dict]:
    """A record's turns (ShareGPT or OpenAI style, normalized by ``to_messages``)."""
    if layout == "acemath":
        return [*(record["messages"] or []), {"role": "assistant", "content": record["answer"]}]
    if layout == "openorca":
        system = (
            [{"role": "system", "content": record["system_prompt"]}] if record.get("system_prompt") else []
        )
        return [
            *system,
            {"role": "user", "content": record["question"]},
            {"role": "assistant", "content": record["response"]},
        ]
    return record[LAYOUTS[layout][0]] or []


def _render(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The chat text and the character spans of its assistant turns."""
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
    return text, spans


def _counted(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    counted = np.zeros(len(starts), dtype=np.int8)
    for a, b in spans:
        counted |= (starts >= a) & (starts < b)
    return counted


def render_conversation(messages: list[dict], tokenizer, loss_on: str = "assistant") -> dict[str, list[int]]:
    """Token ids of a chat and a mask of the tokens the loss counts (before shifting)."""
    text, spans = _render(messages, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if loss_on == "all":
        return {"input_ids": enc["input_ids"], "counted": [1] * len(enc["input_ids"])}
    return {"input_ids": enc["input_ids"], "counted": _counted(enc["offset_mapping"], spans).tolist()}


def long_reply(
    ids: list[int] | np.ndarray,
    counted: np.ndarray,
    min_prompt: int,
    max_reply: int | None = None,
    max_len: int | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The conversation cut after its last reply that starts at ``min_prompt`` tokens or later and before
    ``max_len``, with only that reply counted (its first ``max_reply`` tokens): a served request whose prompt is
    the whole history before the reply.  None when no reply qualifies."""
    counted = np.asarray(counted, dtype=np.int8)
    limit = min(len(ids), max_len or len(ids))
    starts = np.flatnonzero(counted[:limit] & ~np.concatenate([[0], counted[: limit - 1]]).astype(bool))
    starts = starts[(starts >= max(min_prompt, 1)) & (starts < limit - 1)]
    if not len(starts):
        return None
    start = int(starts[-1])
    end = start + int(np.argmin(np.concatenate([counted[start:limit], [0]])))  # the reply's end, within limit
    if max_reply:
        end = min(end, start + max_reply)
    out = np.zeros(end, dtype=np.int8)
    out[start:end] = 1
    return np.asarray(ids[:end]), out


def _tokenize_batch(
    batch: dict[str, list],
    tokenizer,
    layout: str,
    loss_on: str,
    seq_len: int | None,
    min_prompt: int = 0,
    max_reply: int | None = None,
) -> dict:
    """Raw records -> trainable samples (``input_ids``, ``counted``), cut to ``seq_len`` (with ``min_prompt``:
    the ``long_reply`` of each conversation); others are dropped."""
    n = len(batch[LAYOUTS[layout][0]])
    if layout == "text":
        texts = [t for t in batch["text"] if t]
        spans: list = [None] * len(texts)
    else:
        texts, spans = [], []
        for i in range(n):
            messages = to_messages(_turns(layout, {k: v[i] for k, v in batch.items()}))
            if any(m["role"] == "assistant" for m in messages):
                text, s = _render(messages, tokenizer)
                texts.append(text)
                spans.append(s)
    out: dict[str, list] = {"input_ids": [], "counted": []}
    if not texts:
        return out
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    for ids, offsets, s in zip(enc["input_ids"], enc["offset_mapping"], spans, strict=True):
        every = s is None or loss_on == "all"
        counted = np.ones(len(ids), np.int8) if every else _counted(offsets, s)
        if min_prompt:
            cut = long_reply(ids, counted, min_prompt, max_reply, seq_len)
            if cut is None:
                continue
            ids, counted = cut
        ids, counted = ids[:seq_len], counted[:seq_len]
        if counted[1:].any():  # e.g. a long prompt whose reply starts past seq_len: nothing to learn
            out["input_ids"].append(ids)
            out["counted"].append(counted)
    return out


def _stats(source: DataSource, records: list[dict], tokenizer, seq_len: int | None, loss_on: str) -> dict:
    if not records:
        raise DataError(
            f"data source {source.path!r} has no rows (to resolve, check its path, split or max_samples)"
        )
    columns = list(records[0])
    layout = resolve_layout(source, columns)
    batch = {c: [r.get(c) for r in records] for c in columns}
    samples = _tokenize_batch(
        batch,
        tokenizer,
        layout,
        loss_on,
        source.max_tokens or seq_len,
        source.min_prompt_tokens,
        source.max_reply_tokens,
    )
    return {
        "path": source.path,
        "format": layout,
        "columns": columns,
        "rows": len(records),
        "samples": len(samples["input_ids"]),
        "tokens": sum(len(ids) for ids in samples["input_ids"]),
        "assistant_tokens": int(sum(c[1:].sum() for c in samples["counted"])),
    }


def source_stats(
    source: DataSource,
    tokenizer,
    rows: int = PROBE_ROWS,
    seq_len: int | None = None,
    loss_on: str = "assistant",
) -> dict:
    """Counts over the first ``rows`` records of a source, read by streaming (no download of the whole set):
    ``{"path", "format" (the layout), "columns", "rows" (read), "samples" (trainable), "tokens",
    "assistant_tokens" (the tokens the loss counts)}``.  Raises DataError for a gated source without a token,
    a missing file or an unknown layout; an empty source comes back with ``samples == 0``."""
    check_source(source)
    return _stats(source, list(load_source(source, streaming=True).take(rows)), tokenizer, seq_len, loss_on)


def _num_proc(data: DataSection, rows: int) -> int | None:
    n = data.num_proc or min(16, os.cpu_count() or 1, max(1, rows // 10_000))
    return n if n > 1 else None


def tokenize_source(source: DataSource, raw, tokenizer, data: DataSection):
    """The trainable samples of one source, as a cached ``datasets`` map over its raw records."""
    import datasets

    layout = resolve_layout(source, raw.column_names)
    columns = [c for c in (*LAYOUTS[layout], *_OPTIONAL.get(layout, ())) if c in raw.column_names]
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "counted": datasets.List(datasets.Value("int8")),
        }
    )
    raw = raw.select_columns(columns)
    return raw.map(
        _tokenize_batch,
        batched=True,
        fn_kwargs={
            "tokenizer": tokenizer,
            "layout": layout,
            "loss_on": data.loss_on,
            "seq_len": source.max_tokens or data.seq_len,
            "min_prompt": source.min_prompt_tokens,
            "max_reply": source.max_reply_tokens,
        },
        remove_columns=columns,
        features=features,
        num_proc=_num_proc(data, len(raw)),
        desc=f"tokenizing {source.path}",
    )


def _pack_batch(batch: dict[str, list], seq_len: int, pad_id: int, packing: bool) -> dict[str, np.ndarray]:
    """Samples -> rows of ``seq_len``: ``input_ids``, ``position_ids`` (restarting per sample), ``loss_mask``."""
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0

    def flush():
        ids = np.full(seq_len, pad_id, dtype=np.int64)
        pos = np.zeros(seq_len, dtype=np.int64)
        mask = np.zeros(seq_len, dtype=np.int64)
        at = 0
        for s_ids, counted in parts:
            ids[at : at + len(s_ids)] = s_ids
            pos[at : at + len(s_ids)] = np.arange(len(s_ids))
            mask[at : at + len(s_ids) - 1] = counted[1:]  # position t predicts token t+1
            at += len(s_ids)
        pos[at:] = np.arange(seq_len - at)
        rows.append((ids, pos, mask))

    for s_ids, counted in zip(batch["input_ids"], batch["counted"], strict=True):
        s_ids, counted = np.asarray(s_ids[:seq_len]), np.asarray(counted[:seq_len])
        if not counted[1:].any():
            continue
        if parts and (not packing or used + len(s_ids) > seq_len):
            flush()
            parts, used = [], 0
        parts.append((s_ids, counted))
        used += len(s_ids)
    if parts:
        flush()
    return {
        k: np.stack([r[j] for r in rows]) if rows else np.zeros((0, seq_len), np.int64)
        for j, k in enumerate(ROW_COLUMNS)
    }


def pack(samples, seq_len: int, pad_id: int, packing: bool = True) -> dict[str, torch.Tensor]:
    """In-memory packing of a few samples (e.g. held-out rows): [rows, seq_len] tensors of ``ROW_COLUMNS``."""
    batch = {"input_ids": [s["input_ids"] for s in samples], "counted": [s["counted"] for s in samples]}
    return {k: torch.from_numpy(v) for k, v in _pack_batch(batch, seq_len, pad_id, packing).items()}


def pack_dataset(samples, seq_len: int, pad_id: int, packing: bool = True):
    """Packed rows of a ``datasets.Dataset`` of samples, as a torch-formatted ``datasets.Dataset``."""
    import datasets

    small = {"input_ids": "int32", "position_ids": "int32", "loss_mask": "int8"}
    features = datasets.Features(
        {k: datasets.List(datasets.Value(small[k]), length=seq_len) for k in ROW_COLUMNS}
    )
    rows = samples.map(
        _pack_batch,
        batched=True,
        batch_size=PACK_BATCH,
        fn_kwargs={"seq_len": seq_len, "pad_id": pad_id, "packing": packing},
        remove_columns=samples.column_names,
        features=features,
        desc="packing",
    )
    return rows.with_format("torch")


def collate_rows(rows: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DataLoader ``collate_fn`` for packed rows: ``(input_ids, position_ids, loss_mask)``, [batch, seq_len]."""
    return tuple(torch.stack([r[k] for r in rows]) for k in ROW_COLUMNS)


def check_seq_len(data: DataSection, max_positions: int | None) -> None:
    """A row must fit the model's positions (cheap: before any conversion or tokenizing)."""
    if max_positions is not None and data.seq_len > max_positions:
        raise DataError(
            f"data.seq_len={data.seq_len} exceeds the model's max_position_embeddings={max_positions} "
            "(to resolve, lower data.seq_len)"
        )


def build_datasets(data: DataSection, tokenizer, max_positions: int | None = None):
    """Packed train and held-out rows (torch-formatted ``datasets.Dataset`` of ``ROW_COLUMNS``, each row
    ``seq_len`` long) for a recipe's data section.  Every source is checked before any is tokenized."""
    import datasets

    check_seq_len(data, max_positions)
    check_sources(data)
    raws = [load_source(source, cache_dir=data.cache_dir) for source in data.sources]
    for source, raw in zip(data.sources, raws, strict=True):
        stats = _stats(source, _head(raw, PROBE_ROWS).to_list(), tokenizer, data.seq_len, data.loss_on)
        if stats["samples"] == 0:  # e.g. AceMath read as plain messages: no assistant turn in any row
            raise DataError(
                f"data source {source.path!r} yields no trainable sample in its first {stats['rows']} rows "
                f"(layout {stats['format']}, columns {', '.join(stats['columns'])}): no row has an assistant "
                "reply within data.seq_len (to resolve, set data.sources[].format to its layout, or remove it)"
            )
    parts = [
        tokenize_source(source, raw, tokenizer, data) for source, raw in zip(data.sources, raws, strict=True)
    ]
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
    mixed = mixed.shuffle(seed=data.seed)
    n_eval = int(round(len(mixed) * data.holdout))
    if data.holdout > 0 and n_eval == 0 and len(mixed) > 1:
        n_eval = 1
    eval_part, train_part = mixed.select(range(n_eval)), mixed.select(range(n_eval, len(mixed)))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return (
        pack_dataset(train_part, data.seq_len, pad_id, data.packing),
        pack_dataset(eval_part, data.seq_len, pad_id, data.packing),
    )
