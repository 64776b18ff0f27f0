"""DDP communication hooks: plain all-reduce, Bösen managed communication, PowerSGD, and bounded staleness.

``register_comm_hook(ddp_model, cfg)`` installs one hook through torch's ``DistributedDataParallel
.register_comm_hook`` and returns its :class:`CommState`, which counts the bytes every hook puts on the wire.

*Managed* (Bösen, SoCC 2015): each worker adds its gradient to what it has not sent yet (error feedback), cuts
the bucket into blocks, and the ranks agree on the ``budget`` share of blocks with the highest priority (see
``priority``); those go out in one all-reduce, the rest stays queued locally, so no update is ever lost.

*Bounded staleness* (``staleness = s``): a bucket's all-reduce is started and not waited for; the hook hands
DDP the average from step ``t-s`` instead (zeros for the first ``s`` steps).  A fast worker therefore runs on
until it needs the step ``t-s`` average, which exists only once every worker has finished step ``t-s``: no
worker gets more than ``s`` steps ahead of the slowest, every replica applies the same averages in the same
order, and ``s = 0`` is synchronous data parallelism.  Delayed results are kept per parameter, so DDP's
bucket rebuild after the first step does not scramble them.

Bytes are a ring-algorithm estimate per worker: an all-reduce of P bytes sends 2(W-1)/W·P.
"""

import math
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from . import priority
from .config import CommConfig

Future = torch.futures.Future[torch.Tensor]  # the annotation DDP checks hooks for


@dataclass(eq=False)
class CommState:
    """Hook state: configuration, error-feedback residuals, in-flight delayed results and byte counters."""

    cfg: CommConfig
    group: dist.ProcessGroup
    bytes_sent: int = 0  # estimated bytes this worker sent, all steps
    dense_bytes: int = 0  # what plain all-reduce would have sent for the same steps
    last_step_bytes: int = 0
    steps: int = 0
    residual: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)  # param -> unsent part
    ages: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket -> steps since each block left
    delayed: deque = field(default_factory=deque)  # per past step: {param: (future, offset, numel)}
    launching: dict = field(default_factory=dict)
    powersgd: psgd.PowerSGDState | None = None
    names: dict[torch.Tensor, str] = field(default_factory=dict)  # param -> name, for checkpoints
    _step_bytes: int = 0

    @property
    def world(self) -> int:
        return self.group.size()

    def count(self, nbytes: int, dense: int = 0) -> None:
        wire = int(2 * (self.world - 1) / self.world * nbytes)
        self._step_bytes += wire
        self.bytes_sent += wire
        self.dense_bytes += int(2 * (self.world - 1) / self.world * dense)

    def end_step(self) -> None:
        self.last_step_bytes, self._step_bytes = self._step_bytes, 0
        self.steps += 1

    def state_dict(self) -> dict:
        """Residuals, the delayed averages still to apply (waited for) and the counters, by parameter name,
        so that ``accelerator.register_for_checkpointing(state)`` resumes without losing an update."""
        if self.powersgd is not None:
            raise ValueError("comm hook: checkpointing PowerSGD state is not supported; use hook=managed")
        delayed = [
            {self.names[p]: f.wait()[o : o + n].clone() for p, (f, o, n) in s.items()} for s in self.delayed
        ]
        return {
            "residual": {self.names[p]: r.clone() for p, r in self.residual.items()},
            "delayed": delayed,
            "ages": dict(self.ages),
            "counters": [self.bytes_sent, self.dense_bytes, self.last_step_bytes, self.steps],
        }

    def load_state_dict(self, sd: dict) -> None:
        params = {n: p for p, n in self.names.items()}
        self.residual = {params[n]: r.to(params[n].device) for n, r in sd["residual"].items()}
        self.delayed = deque(
            {params[n]: (_done(t.to(params[n].device)), 0, t.numel()) for n, t in s.items()}
            for s in sd["delayed"]
        )
        self.ages = dict(sd["ages"])
        self.bytes_sent, self.dense_bytes, self.last_step_bytes, self.steps = sd["counters"]

    def summary(self) -> dict[str, float]:
        return {
            "comm_steps": self.steps,
            "comm_bytes": self.bytes_sent,
            "comm_bytes_last_step": self.last_step_bytes,
            "comm_byte_ratio": self.bytes_sent / self.dense_bytes if self.dense_bytes else 1.0,
        }


def _done(tensor: torch.Tensor) -> Future:
    fut: Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _allreduce(state: CommState, tensor: torch.Tensor) -> Future:
    """Average ``tensor`` over the group in place (asynchronously); counts its bytes."""
    state.count(tensor.numel() * tensor.element_size())
    tensor.div_(state.world)
    return dist.all_reduce(tensor, group=state.group, async_op=True).get_future().then(lambda f: f.value()[0])


def _flat_params(bucket: dist.GradBucket) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in bucket.parameters()])


def _managed(state: CommState, bucket: dist.GradBucket) -> Future:
    cfg, buf, params = state.cfg, bucket.buffer(), bucket.parameters()
    numels = [p.numel() for p in params]
    update = torch.cat([state.residual.get(p, buf.new_zeros(n)) for p, n in zip(params, numels, strict=True)])
    update += buf
    num_blocks = math.ceil(buf.numel() / cfg.block_size)
    k = min(num_blocks, max(1, round(cfg.budget * num_blocks)))
    if k == num_blocks:
        state.residual.clear()
        return _allreduce(state, update)
    if cfg.priority in ("relative-magnitude", "magnitude"):
        x = _flat_params(bucket) if cfg.priority == "relative-magnitude" else None
        scores = priority.magnitude_scores(update, x, cfg.block_size)
        state.count(scores.numel() * scores.element_size())
        dist.all_reduce(scores, group=state.group)
    elif cfg.priority == "random":
        scores = priority.random_scores(num_blocks, cfg.seed, state.steps, bucket.index())
    else:
        ages = state.ages.get(bucket.index())
        if ages is None or ages.numel() != num_blocks:
            ages = state.ages[bucket.index()] = torch.zeros(num_blocks)
        scores = priority.fifo_scores(ages)
    chosen = priority.choose(scores, k).to(buf.device)
    if cfg.priority == "fifo":
        ages += 1
        ages[chosen.cpu()] = 0
    blocked = priority.blocks(update, cfg.block_size)
    sent = blocked[chosen].contiguous()
    blocked[chosen] = 0
    unsent = blocked.view(-1)[: buf.numel()]
    state.residual.update(zip(params, unsent.split(numels), strict=True))

    def scatter(fut: Future) -> torch.Tensor:
        out = torch.zeros_like(blocked)
        out[chosen] = fut.value()
        return out.view(-1)[: buf.numel()]

    return _allreduce(state, sent).then(scatter)


def _delay(state: CommState, bucket: dist.GradBucket, fut: Future) -> Future:
    """Record this step's result per parameter and return the result of ``staleness`` steps ago."""
    params, offset = bucket.parameters(), 0
    for p in params:
        state.launching[p] = (fut, offset, p.numel())
        offset += p.numel()
    if len(state.delayed) < state.cfg.staleness:
        return _done(torch.zeros_like(bucket.buffer()))
    old = [state.delayed[0][p] for p in params]
    unique = list({id(f): f for f, _, _ in old}.values())
    return torch.futures.collect_all(unique).then(
        lambda _: torch.cat([f.value()[o : o + n] for f, o, n in old])
    )


def managed_hook(state: CommState, bucket: dist.GradBucket) -> Future:
    """The hook for ``allreduce`` and ``managed`` (with or without staleness); see the module docstring."""
    buf = bucket.buffer()
    state.count(0, dense=buf.numel() * buf.element_size())
    if sum(p.numel() for p in bucket.parameters()) != buf.numel():
        raise ValueError("comm hook: a DDP bucket holds padding between gradients; use comm.hook=allreduce")
    if state.cfg.hook == "managed":
        fut = _managed(state, bucket)
    else:
        fut = _allreduce(state, buf if state.cfg.staleness == 0 else buf.clone())
    if state.cfg.staleness:
        fut = _delay(state, bucket, fut)
        if bucket.is_last():
            state.delayed.append(state.launching)
            state.launching = {}
            if len(state.delayed) > state.cfg.staleness:
                state.delayed.popleft()
    if bucket.is_last():
        state.end_step()
    return fut


def powersgd_hook(state: CommState, bucket: dist.GradBucket) -> Future:
    """torch's PowerSGD hook, with its bytes counted from its own compression statistics."""
    buf, ps = bucket.buffer(), state.powersgd
    before, warmup = ps.total_numel_after_compression, ps.iter < ps.start_powerSGD_iter
    size, numel = buf.element_size(), buf.numel()
    fut = psgd.powerSGD_hook(ps, bucket)
    sent = numel if warmup else ps.total_numel_after_compression - before
    state.count(sent * size, dense=numel * size)
    if bucket.is_last():
        state.end_step()
    return fut


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    cfg: CommConfig,
    process_group: dist.ProcessGroup | None = None,
) -> CommState:
    """Install the hook chosen by ``cfg`` on a DDP model; the returned state measures bytes per step."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"register_comm_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}; "
            "to resolve, pass the model returned by accelerator.prepare in a multi-process run"
        )
    names = {p: n for n, p in ddp_model.module.named_parameters()}
    state = CommState(cfg, process_group or dist.group.WORLD, names=names)
    if cfg.hook == "powersgd":
        state.powersgd = psgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_iter,
            random_seed=cfg.seed,
        )
        ddp_model.register_comm_hook(state, powersgd_hook)
    else:
        ddp_model.register_comm_hook(state, managed_hook)
    return state


def attach_comm_hook(model: torch.nn.Module, cfg: CommConfig) -> CommState | None:
    """``register_comm_hook`` for a model as ``accelerator.prepare`` returned it: a DDP model gets the hook;
    any other (one process, DeepSpeed) is left alone when ``cfg`` asks for nothing beyond plain all-reduce."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return register_comm_hook(model, cfg)
    if cfg.hook != "allreduce" or cfg.staleness:
        raise ValueError(
            f"comm.hook={cfg.hook} with staleness={cfg.staleness} needs the multi-process DDP path, but the "
            f"model is a {type(model).__name__}; to resolve, launch >= 2 processes without DeepSpeed, or drop "
            "the comm section"
        )
    return None
