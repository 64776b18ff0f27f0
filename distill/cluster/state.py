"""What a scheduling policy knows about one job in one round (shared by the planner CLI and the simulator)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .configs import Config, job_configs
from .spec import Cluster, Job
from .throughput import ThroughputModel


@dataclass
class JobState:
    """A job's static spec plus its dynamic state: throughput model, current configuration, restarts."""

    job: Job
    model: ThroughputModel = field(default_factory=ThroughputModel)
    arrival_s: float = 0.0
    requested_gpus: int = 1
    """Fixed request used by the baselines (Gavel-like, FIFO); Sia ignores it."""
    current: Config | None = None
    restarts: int = 0
    age_s: float = 0.0
    _fits: list[Config] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.job.name

    def fits(self, cluster: Cluster) -> list[Config]:
        """Configurations the job fits in (computed once; the cluster of a job does not change)."""
        if self._fits is None:
            self._fits = job_configs(self.job, cluster)
        return self._fits

    def candidates(self, cluster: Cluster, explore: int = 2) -> list[Config]:
        """Configurations the job fits in, whose type is profiled, within the exploration limit.

        The current configuration is always a candidate (a job may keep what it has).
        """
        limit = self.model.explore_limit(explore)
        profiled = self.model.profiled_types()
        out = [c for c in self.fits(cluster) if c.gpu_type in profiled and c.gpus <= limit]
        if self.current is not None and self.current not in out:
            out.append(self.current)
        return out
