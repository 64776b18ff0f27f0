"""The distillation objective: teacher = the same weights in original mode, student = the SwiftKV path.

``kd_loss`` is forward KL(teacher || student) at temperature T, scaled by T^2, averaged over the counted
tokens (``normalize="counted"``) or summed over them and divided by every position of the batch
(``normalize="positions"``, the reference trainer's ``mean(kl * mask)``); the hidden-state MSE likewise over
counted tokens or over every position.  Only counted positions are projected onto the vocabulary, and in
chunks of ``chunk_tokens`` rows whose logits are recomputed in backward (activation checkpointing), so peak
memory is one chunk of [chunk_tokens, vocab] logits whatever the sequence length.  The chunked value and gradient equal the plain
computation (tests/distill/test_objective.py).

``DistillationObjective`` wraps the causal LM so that accelerate/DeepSpeed see one module whose forward
returns the loss.  It knows only the model's small distillation interface: ``set_mode``,
``swiftkv_parameter_names`` and ``model.teacher_student_hidden`` (layers < l computed once for both paths).
With exact K/V (``config.exact_kv_window``), the student's exact positions come from the loss mask
(``swiftkv.modeling_swiftkv.exact_kv_positions``): the tokens a served reply runs through every layer.
The student's layers >= l run only the rows the loss reads and the exact ones (``student_rows_hidden``): a short
reply after a long prompt costs the student a few rows, not the whole sequence.  With ``shared_lower_layers=False``
it runs two ordinary forward passes instead (the naive baseline).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swiftkv.modeling_swiftkv import exact_kv_positions

from .recipe import LossSection


def _chunk_kl(
    student: torch.Tensor, teacher: torch.Tensor, head: nn.Module, temperature: float
) -> torch.Tensor:
    s = F.log_softmax(head(student).float() / temperature, dim=-1)
    with torch.no_grad():
        t = F.log_softmax(head(teacher).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="sum")


def _chunks(mask: torch.Tensor, chunk_tokens: int, *tensors: torch.Tensor):
    """Fixed slices over all positions of each [batch, seq, ...] tensor, each reduced to its counted rows.

    The number of slices depends only on the batch shape, never on the mask, so every rank calls the
    vocabulary head equally often: ZeRO-3 gathers the head's weight at each call, and a rank that called it
    less would desynchronize the collectives.
    """
    rows = mask.reshape(-1).bool()
    flat = [t.reshape(rows.shape[0], *t.shape[2:]) for t in tensors]
    for i in range(0, rows.shape[0], chunk_tokens):
        keep = rows[i : i + chunk_tokens]
        yield [t[i : i + chunk_tokens][keep] for t in flat]


def kd_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    head: nn.Module,
    mask: torch.Tensor,
    temperature: float = 2.0,
    chunk_tokens: int = 1024,
    normalize: str = "counted",
) -> torch.Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)) summed over counted tokens, divided by their number
    (``normalize="counted"``) or by every position of ``mask`` (``"positions"``).

    student/teacher: [batch, seq, hidden] (or logits, with ``head=nn.Identity()``); mask: [batch, seq] of 0/1.
    """
    recompute = mask.numel() > chunk_tokens and torch.is_grad_enabled()
    total = student.new_zeros((), dtype=torch.float32)
    for s, t in _chunks(mask, chunk_tokens, student, teacher):
        if recompute:
            total = total + checkpoint(_chunk_kl, s, t, head, temperature, use_reentrant=False)
        else:
            total = total + _chunk_kl(s, t, head, temperature)
    return total * temperature**2 / _denominator(mask, normalize)


def _denominator(mask: torch.Tensor, normalize: str) -> torch.Tensor | int:
    if normalize == "positions":
        return mask.numel()
    if normalize == "counted":
        return mask.sum().clamp(min=1)
    raise ValueError(f"normalize={normalize!r}: expected counted or positions")


@torch.no_grad()
def token_agreement(
    student: torch.Tensor,
    teacher: torch.Tensor,
    head: nn.Module,
    mask: torch.Tensor,
    chunk_tokens: int = 1024,
    input_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per counted token, in order: [KL at T=1, top-1 agreement, 1, student NLL, teacher NLL], [counted, 5].  The
    NLLs are of the next token in ``input_ids`` (position t predicts t+1; the last position of a row is never
    counted by the data), zero without ``input_ids``."""
    if input_ids is None:
        input_ids = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], 1)
    out = []
    for s, t, y in _chunks(mask, chunk_tokens, student, teacher, targets):
        s, t = F.log_softmax(head(s).float(), -1), F.log_softmax(head(t).float(), -1)
        kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)
        top1 = (s.argmax(-1) == t.argmax(-1)).to(kl.dtype)
        nll = [-x.gather(-1, y[:, None])[:, 0] for x in (s, t)]
        out.append(torch.stack([kl, top1, torch.ones_like(kl), *nll], -1).double())
    out = torch.cat(out) if out else torch.zeros(0, 5, dtype=torch.float64, device=student.device)
    if not input_ids.any():
        out[:, 3:] = 0
    return out


@torch.no_grad()
def agreement_metrics(
    student: torch.Tensor,
    teacher: torch.Tensor,
    head: nn.Module,
    mask: torch.Tensor,
    chunk_tokens: int = 1024,
    input_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sums over counted tokens of ``token_agreement`` (sums, so ranks can add them)."""
    return token_agreement(student, teacher, head, mask, chunk_tokens, input_ids).sum(0)


def metrics_from_sums(sums: torch.Tensor) -> dict[str, float]:
    """Means of ``agreement_metrics`` sums: KL, top-1 agreement, token count and both perplexities."""
    n = max(sums[2].item(), 1.0)
    return {
        "kl": sums[0].item() / n,
        "top1_agreement": sums[1].item() / n,
        "tokens": int(sums[2].item()),
        "ppl_teacher": math.exp(sums[4].item() / n),
        "ppl_student": math.exp(sums[3].item() / n),
    }


def masked_mse(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, normalize: str = "counted"
) -> torch.Tensor:
    """Mean over counted tokens (``normalize="positions"``: over every position) of the mean squared difference
    over the hidden size."""
    per_token = (student.float() - teacher.float()).pow(2).mean(-1)
    if normalize == "positions":
        return per_token.mean()
    return (per_token * mask).sum() / _denominator(mask, normalize)


def last_replies(loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The last run of counted positions of each packed sample (``position_ids`` restart at 0 per sample):
    [batch, seq] bool."""
    scored = loss_mask.bool()
    restart = position_ids == 0
    starts = scored & (~F.pad(scored[:, :-1], (1, 0)) | restart)
    run, sample = starts.cumsum(-1), restart.cumsum(-1)
    last = torch.zeros(run.shape[0], run.shape[1] + 1, dtype=run.dtype, device=run.device)
    last.scatter_reduce_(1, sample, torch.where(scored, run, 0), "amax")
    return scored & (run == last.gather(1, sample))


def served_positions(
    loss_mask: torch.Tensor, position_ids: torch.Tensor, window: int, replies: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The positions the loss counts and, with exact K/V (``exact_kv_window`` W > 0), the ones that take them.

    Each counted reply must be in a regime some served request produces: ``replies="last"`` counts only each
    packed sample's last reply, its history (earlier replies included) prompt with SwiftKV K/V (a request
    without a prefix-cache hit); ``"all"`` counts every reply, each generated with exact K/V (a chat continued
    in its own cache).  Exact: the counted positions (a reply and the last prompt token before it all run every
    layer when the reply is generated) and the W - 1 prompt positions before each counted reply."""
    if not window:
        return loss_mask, None
    if replies == "last":
        loss_mask = last_replies(loss_mask, position_ids).to(loss_mask.dtype)
    return loss_mask, exact_kv_positions(loss_mask, position_ids, window)


class DistillationObjective(nn.Module):
    """One module whose forward is the distillation loss of a batch (and metrics in eval mode)."""

    def __init__(self, model: nn.Module, loss: LossSection, shared_lower_layers: bool = True):
        super().__init__()
        self.model = model
        self.loss_cfg = loss
        self.shared_lower_layers = shared_lower_layers

    @property
    def causal_lm(self) -> nn.Module:
        """The SwiftKV causal LM, also when peft wraps it."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def _hidden(self, input_ids, position_ids, exact_mask, loss_mask):
        lm = self.causal_lm
        if self.shared_lower_layers:
            # the student's layers >= l run only the rows the loss reads (and the exact ones), unless the MSE
            # is a mean over every position
            wanted = self.loss_cfg.normalize == "counted" or self.loss_cfg.mse_weight == 0
            query = (
                None
                if not wanted
                else loss_mask.bool()
                if exact_mask is None
                else loss_mask.bool() | exact_mask
            )
            teacher, student, t_in, s_in = lm.model.teacher_student_hidden(
                input_ids, position_ids=position_ids, exact_mask=exact_mask, query_mask=query
            )
            return teacher, student, t_in, s_in, lm.lm_head
        lm.set_mode("teacher")
        with torch.no_grad():
            t_out = lm(input_ids, position_ids=position_ids, use_cache=False, output_hidden_states=True)
        lm.set_mode("student")
        s_out = lm(
            input_ids,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=True,
            swiftkv_exact_mask=exact_mask,
        )
        return t_out.logits, s_out.logits, t_out.hidden_states[-2], s_out.hidden_states[-2], nn.Identity()

    def forward(self, input_ids, position_ids, loss_mask) -> dict[str, torch.Tensor]:
        cfg = self.loss_cfg
        window = getattr(self.causal_lm.config, "exact_kv_window", 0)
        loss_mask, exact = served_positions(loss_mask, position_ids, window, cfg.exact_kv_replies)
        teacher, student, t_in, s_in, head = self._hidden(input_ids, position_ids, exact, loss_mask)
        mask = loss_mask.to(student.dtype)
        kl = kd_loss(student, teacher, head, loss_mask, cfg.temperature, cfg.chunk_tokens, cfg.normalize)
        mse = masked_mse(s_in, t_in, mask, cfg.normalize) if cfg.mse_weight > 0 else kl.new_zeros(())
        out = {"loss": cfg.kl_weight * kl + cfg.mse_weight * mse, "kl": kl.detach(), "mse": mse.detach()}
        if not self.training:
            out["metrics"] = agreement_metrics(student, teacher, head, loss_mask, cfg.chunk_tokens, input_ids)
        return out
