"""Synthetic job traces in the spirit of Microsoft's Philly trace, generated from a seed (nothing copied).

Each job has an arrival time, an amount of work (samples), a user GPU request (mostly 1 GPU, a tail up to
whole nodes, as in Philly), an elasticity limit, and a true scaling behaviour that the simulator uses and
the policies never see directly:

    t_iter(N GPUs of type A on n nodes) = batch / (N · thr1_A) + c · 2(N − 1)/N,
    c = comm_intra_s on one node, comm_inter_s across nodes;  throughput = batch / t_iter.

A restart (any change of allocation: start, migration, scale up or down) costs 30-90 s times (1 + the model's
billions of parameters), the time to reload the checkpoint and re-initialize the engine.
Per-type 1-GPU speed grows with the type's ``tflops`` to a per-category power (small, memory-bound models
gain little from faster GPUs; large ones gain most), so the best GPU type differs between jobs.  Because
communication does not speed up with the GPU, fast types scale worse, so Sia's shared-shape rule is only
an estimate here, refined from observations.
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from .configs import Config
from .spec import Cluster

# name: (student params B, batch, thr1 on a tflops=1 GPU, tflops exponent, comm intra s, comm inter s, max gpus)
CATEGORIES = {
    "small": (0.135, 64, 60.0, 0.4, 0.02, 0.25, 8),
    "medium": (1.5, 128, 10.0, 0.8, 0.12, 1.2, 32),
    "large": (3.0, 256, 5.0, 1.0, 0.25, 1.5, 64),
}
CATEGORY_P = (0.55, 0.3, 0.15)
REQUESTS, REQUEST_P = (1, 2, 4, 8, 16), (0.55, 0.1, 0.15, 0.12, 0.08)


@dataclass
class TraceJob:
    """One job of a trace, with its true behaviour."""

    name: str
    arrival_s: float
    category: str
    work: float
    requested_gpus: int
    max_gpus: int
    batch: int
    comm_intra_s: float
    comm_inter_s: float
    restart_s: float
    student_params_b: float
    thr1: dict[str, float]

    def tuned_gpus(self, cluster: Cluster, min_efficiency: float = 0.8) -> int:
        """The GPU count an expert would request: on the job's fastest type, the largest configuration whose
        scaling efficiency thr(N) / (N · thr(1)) stays ≥ ``min_efficiency`` (the knee; within ``max_gpus``)."""
        from .configs import type_configs

        gpu = cluster.type(max(self.thr1, key=self.thr1.get))
        ones = self.throughput(Config(gpu.name, 1, 1))
        sizes = [
            c.gpus
            for c in type_configs(gpu)
            if c.gpus <= self.max_gpus and self.throughput(c) >= min_efficiency * c.gpus * ones
        ]
        return max(sizes, default=1)

    def throughput(self, config: Config) -> float:
        """True samples/s on ``config``."""
        n = config.gpus
        comm = (
            0.0
            if n == 1
            else (self.comm_intra_s if config.nodes == 1 else self.comm_inter_s) * 2 * (n - 1) / n
        )
        return self.batch / (self.batch / (n * self.thr1[config.gpu_type]) + comm)


def generate_trace(
    cluster: Cluster, num_jobs: int = 160, hours: float = 8.0, seed: int = 0
) -> list[TraceJob]:
    """Poisson arrivals over ``hours``; lognormal durations (median 30 min on the request, 5 min..12 h)."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.uniform(0, hours * 3600, num_jobs))
    ref = min(
        cluster.gpu_types, key=lambda t: abs(t.tflops - np.median([g.tflops for g in cluster.gpu_types]))
    )
    jobs = []
    for k, arrival in enumerate(arrivals):
        cat = str(rng.choice(list(CATEGORIES), p=CATEGORY_P))
        params, batch, base, expo, c_in, c_out, max_gpus = CATEGORIES[cat]
        request = int(rng.choice(REQUESTS, p=REQUEST_P))
        request = min(request, max_gpus, ref.capacity)
        jitter = rng.lognormal(0, 0.15, len(cluster.gpu_types))
        thr1 = {
            t.name: float(base * t.tflops**expo * j) for t, j in zip(cluster.gpu_types, jitter, strict=True)
        }
        job = TraceJob(
            name=f"job{k:04d}",
            arrival_s=round(float(arrival), 1),
            category=cat,
            work=0.0,
            requested_gpus=request,
            max_gpus=max_gpus,
            batch=batch,
            comm_intra_s=c_in * float(rng.uniform(0.7, 1.3)),
            comm_inter_s=c_out * float(rng.uniform(0.7, 1.3)),
            restart_s=float(rng.uniform(30, 90))
            * (1 + params),  # checkpoint load + engine init grow with size
            student_params_b=params,
            thr1=thr1,
        )
        nodes = -(-request // ref.gpus_per_node)
        duration = float(np.clip(rng.lognormal(np.log(1800), 1.2), 300, 12 * 3600))
        job.work = round(duration * job.throughput(Config(ref.name, nodes, request)), 1)
        jobs.append(job)
    return jobs


_SCALARS = [f.name for f in fields(TraceJob) if f.name != "thr1"]


def write_trace(path: Path | str, jobs: list[TraceJob]) -> None:
    """CSV with one row per job; per-type 1-GPU throughputs as ``thr1_<type>`` columns."""
    types = sorted({t for j in jobs for t in j.thr1})
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_SCALARS + [f"thr1_{t}" for t in types])
        for j in jobs:
            d = asdict(j)
            w.writerow([d[k] for k in _SCALARS] + [j.thr1[t] for t in types])
    tmp.replace(path)


def read_trace(path: Path | str, cluster: Cluster) -> list[TraceJob]:
    """Read a trace CSV; every row must give a 1-GPU throughput for every GPU type of ``cluster``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such trace; to resolve, make one with `swiftkv cluster trace`")
    types = [t.name for t in cluster.gpu_types]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: empty trace; to resolve, make one with `swiftkv cluster trace`")
    missing = [c for c in _SCALARS + [f"thr1_{t}" for t in types] if c not in rows[0]]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; to resolve, regenerate it for this cluster")
    jobs = []
    for line, r in enumerate(rows, start=2):
        try:
            jobs.append(
                TraceJob(
                    **{k: type_(r[k]) for k, type_ in _casts().items()},
                    thr1={t: float(r[f"thr1_{t}"]) for t in types},
                )
            )
        except ValueError as e:
            raise ValueError(f"{path}:{line}: {e}; to resolve, fix or regenerate the row") from None
    return jobs


def _casts() -> dict[str, type]:
    hints = {f.name: f.type for f in fields(TraceJob)}
    cast = {"str": str, "float": float, "int": int}
    return {k: cast[hints[k]] for k in _SCALARS}
