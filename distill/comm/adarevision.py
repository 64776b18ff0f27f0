"""AdaRevision (Bösen, SoCC 2015): AdaGrad that revises its step size for gradients computed on stale values.

Per coordinate, with state z = 1, z_max = 1, the running gradient sum ḡ = 0, and ḡ_read = the value of ḡ when
the parameters the gradient was computed on were read::

    g_bck = ḡ - ḡ_read;  η_old = α/√z_max
    z += g² + 2·g·g_bck;  z_max = max(z_max, z);  η = α/√z_max
    x += -η·g + (η_old - η)·g_bck;  ḡ += g

Without delay g_bck = 0, z only grows, and this is AdaGrad with accumulator start 1 (steps never increase).
``delay=d`` is the fixed-delay pipeline of the bounded-staleness hook: the gradient applied at step t was
computed on the parameters read at the start of step t-d, so ḡ_read is ḡ as it was then (the optimizer keeps
the last d snapshots).  A caller with its own timing passes ``read=`` (from :meth:`snapshot`) to ``step``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class AdaRevision(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1, delay: int = 0):
        if lr <= 0:
            raise ValueError(f"AdaRevision lr={lr} must be > 0; to resolve, pass a positive lr")
        if delay < 0:
            raise ValueError(f"AdaRevision delay={delay} must be >= 0; to resolve, pass comm.staleness")
        super().__init__(params, {"lr": lr, "delay": delay})

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["z"] = torch.ones_like(p, memory_format=torch.preserve_format)
            state["z_max"] = torch.ones_like(p, memory_format=torch.preserve_format)
            state["gsum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["reads"] = []  # ḡ at the start of each of the last `delay` steps
        return state

    @torch.no_grad()
    def snapshot(self) -> list[torch.Tensor]:
        """ḡ of every parameter with a gradient-to-come, in ``param_groups`` order (take it when reading x)."""
        return [self._state(p)["gsum"].clone() for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable | None = None, read: list[torch.Tensor] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        reads = iter(read) if read is not None else None
        for group in self.param_groups:
            alpha, delay = group["lr"], group["delay"]
            for p in group["params"]:
                explicit = next(reads) if reads is not None else None
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdaRevision does not support sparse gradients")
                state, g = self._state(p), p.grad
                if explicit is not None:
                    g_bck = state["gsum"] - explicit
                elif delay:
                    state["reads"].append(state["gsum"].clone())
                    g_bck = state["gsum"] - state["reads"][0]
                    del state["reads"][:-delay]
                else:
                    g_bck = None
                eta_old = alpha / state["z_max"].sqrt()
                if g_bck is None:
                    state["z"].addcmul_(g, g)
                else:
                    state["z"].addcmul_(g, g + 2 * g_bck)
                torch.maximum(state["z_max"], state["z"], out=state["z_max"])
                eta = alpha / state["z_max"].sqrt()
                p.addcmul_(eta, g, value=-1)
                if g_bck is not None:
                    p.addcmul_(eta_old - eta, g_bck)
                state["gsum"].add_(g)
        return loss
