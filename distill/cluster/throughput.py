"""Bootstrapped per-job throughput model (Sia §4): profile small, estimate the rest, refine as jobs run.

A new job is profiled on the smallest configuration of each GPU type.  Other GPU counts are estimated with
Sia's scaling rule thr(N, A) = thr(1, A) / thr(1, B) · thr(N, B): the *shape* of the scaling curve is shared
across GPU types and only its height differs.  The shared shape is the speedup
s(N, n) = N / (1 + a·(N − 1) + b·(n − 1)) over N GPUs on n nodes (intra- and inter-node communication
overheads a, b ≥ 0), fitted by non-negative least squares (``scipy.optimize.nnls``) to every multi-GPU
observation on a type that also has a 1-GPU observation.  With one observed point the fit reproduces the
paper's ratio rule exactly; with none it is linear scaling, which is why planners cap exploration
(``explore_limit``) to a few times the largest count seen so far.  Exact observations always win.
"""

from __future__ import annotations

from .configs import Config


class ThroughputModel:
    """Throughput estimates (samples/s) of one job on every configuration."""

    def __init__(self, smoothing: float = 0.5) -> None:
        self.smoothing = smoothing
        self._obs: dict[Config, float] = {}
        self._coef: tuple[float, float] | None = None

    def observe(self, config: Config, throughput: float) -> None:
        """Record a measured throughput (exponentially smoothed when the configuration was seen before)."""
        if throughput <= 0:
            raise ValueError(f"throughput {throughput} on {config} must be positive")
        old = self._obs.get(config)
        new = throughput if old is None else self.smoothing * throughput + (1 - self.smoothing) * old
        if old is None or abs(new - old) > 0.02 * old:
            self._coef = None  # refit lazily; tiny drifts keep the old fit
        self._obs[config] = new

    @property
    def observations(self) -> dict[Config, float]:
        return dict(self._obs)

    def profiled_types(self) -> set[str]:
        return {c.gpu_type for c in self._obs}

    def explore_limit(self, factor: int = 2) -> int:
        """Largest GPU count worth trying now: ``factor`` times the largest count observed on any type."""
        return factor * max((c.gpus for c in self._obs), default=1)

    def _fit(self) -> tuple[float, float]:
        if self._coef is None:
            import numpy as np
            from scipy.optimize import nnls

            ones = {c.gpu_type: thr for c, thr in self._obs.items() if c.gpus == 1}
            rows, rhs = [], []
            for c, thr in self._obs.items():
                if c.gpus > 1 and c.gpu_type in ones:
                    speedup = thr / ones[c.gpu_type]
                    rows.append([c.gpus - 1, c.nodes - 1])
                    rhs.append(c.gpus / speedup - 1.0)
            if rows:
                coef, _ = nnls(np.asarray(rows, float), np.asarray(rhs, float))
                self._coef = (float(coef[0]), float(coef[1]))
            else:
                self._coef = (0.0, 0.0)
        return self._coef

    def speedup(self, gpus: int, nodes: int) -> float:
        """Fitted s(N, n), the shared scaling shape (s(1, 1) = 1)."""
        a, b = self._fit()
        return gpus / (1.0 + a * (gpus - 1) + b * (nodes - 1))

    def estimate(self, config: Config) -> float | None:
        """Observed or estimated throughput on ``config``; None when its GPU type was never profiled."""
        if config in self._obs:
            return self._obs[config]
        refs = [c for c in self._obs if c.gpu_type == config.gpu_type]
        if not refs:
            return None
        ref = min(refs, key=lambda c: abs(c.gpus - config.gpus))
        return self._obs[ref] * self.speedup(config.gpus, config.nodes) / self.speedup(ref.gpus, ref.nodes)
