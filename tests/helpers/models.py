"""Tiny random models built in the test (no download): base Llama / Qwen2 / Qwen3 causal LMs, SwiftKV students
converted from them in memory, the batches they run on, and the teacher-student KL."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from swiftkv import convert

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def tiny_base(family: str = "llama", seed: int = 0, **overrides):
    """A small random Llama, Qwen2 or Qwen3 causal LM in eval mode."""
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    elif family == "qwen3":  # head_dim given explicitly: Qwen3Config defaults it to 128
        model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "head_dim": 16, **overrides}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides}))
    # random biases and Qwen3 head norms, so the tests see them (transformers initializes them to 0 and 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def tiny_chat_base(tokenizer, family: str = "llama"):
    """A tiny random ``family`` model sized for ``tokenizer``, with peaked output distributions (initializer
    range 0.2), so that a teacher-student KL is measurable."""
    return tiny_base(
        family,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=0.2,
    )


def to_swiftkv(base, l: int, g: int = 1, perturb: bool = True):
    """Convert in memory, with the new weights perturbed so that the SwiftKV path really differs from the
    teacher (as after distillation)."""
    model = convert.to_swiftkv(base, l, g)
    if perturb:
        torch.manual_seed(1)
        with torch.no_grad():
            for name in model.swiftkv_parameter_names():
                param = model.get_parameter(name)
                param.add_(0.05 * torch.randn_like(param))
    return model


def left_padded_batch(lengths=(9, 5, 7), vocab=128, pad=0):
    """Random sequences of ``lengths``, and the batch of them left-padded: (sequences, input ids, mask)."""
    torch.manual_seed(3)
    seqs = [torch.randint(3, vocab, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    return seqs, ids, mask


def token_batches(seed: int, count: int = 3, length: int = 96) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of 2 random sequences of ``length`` tokens (the K/V fits' data)."""
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 128, (2, length), generator=gen)} for _ in range(count)]


def teacher_student_kl(model, data) -> float:
    """KL(teacher || student) of next-token distributions, summed over ``data``."""
    total = 0.0
    with torch.no_grad():
        for batch in data:
            model.set_mode("teacher")
            teacher = model(**batch).logits.log_softmax(-1)
            model.set_mode("student")
            student = model(**batch).logits.log_softmax(-1)
            total += torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="sum").item()
    return total
