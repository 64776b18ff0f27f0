"""Input files of the cluster planner: the cluster (GPU types and nodes) and the jobs to place.

Both are pydantic models with ``extra="forbid"``; loaders turn every problem into one ``ValueError`` line
that names the file and the fix, before any planning starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..shipped import find


def _require_unique(names: list[str], what: str) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate {what} names {dup}; to resolve, give each {what} its own name")


class GpuType(BaseModel):
    """One kind of accelerator and how many nodes of it the cluster has."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Short identifier used in job profiles, traces and plans (e.g. ``a100``)."""
    nodes: int = Field(ge=1)
    """Number of nodes of this type."""
    gpus_per_node: int = Field(ge=1)
    """GPUs on each node; a power of two, so that the placer can always pack what the ILP allocates."""
    memory_gb: float = Field(gt=0)
    """Memory of one GPU, used to decide which configurations a job fits in and its ZeRO stage."""
    tflops: float = Field(default=1.0, gt=0)
    """Relative compute speed; only the synthetic trace generator reads it."""
    bf16: bool = True
    """Whether the GPU computes in bfloat16 (false for T4, V100 and older): bf16 jobs are never placed there."""
    hosts: list[str] | None = None
    """Host names of the nodes, for launch configs; default ``<name>-<i>``."""

    @field_validator("gpus_per_node")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(
                f"gpus_per_node={v} is not a power of two; to resolve, list the usable GPUs (1, 2, 4, 8, ...)"
            )
        return v

    @model_validator(mode="after")
    def _hosts_match(self) -> GpuType:
        if self.hosts is not None and len(self.hosts) != self.nodes:
            raise ValueError(
                f"{len(self.hosts)} hosts for {self.nodes} nodes; to resolve, list one host per node"
            )
        return self

    @property
    def capacity(self) -> int:
        return self.nodes * self.gpus_per_node

    def host(self, node: int) -> str:
        return self.hosts[node] if self.hosts else f"{self.name}-{node}"


class Cluster(BaseModel):
    """``cluster.yaml``: the GPU types of a (possibly heterogeneous) cluster."""

    model_config = ConfigDict(extra="forbid")

    gpu_types: list[GpuType] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Cluster:
        _require_unique([t.name for t in self.gpu_types], "GPU type")
        return self

    def type(self, name: str) -> GpuType:
        for t in self.gpu_types:
            if t.name == name:
                return t
        raise KeyError(f"unknown GPU type {name!r}; valid: {[t.name for t in self.gpu_types]}")

    @property
    def total_gpus(self) -> int:
        return sum(t.capacity for t in self.gpu_types)


class Observation(BaseModel):
    """A measured throughput of a job on ``gpus`` GPUs of one type (a profile run or a running job)."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: str
    gpus: int = Field(ge=1)
    throughput: float = Field(gt=0)
    """Samples per second for the whole job."""


class Placement(BaseModel):
    """Where a job runs now: its GPU type, and GPU indices per node index."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: str
    gpus: dict[int, list[int]]
    """node index -> local GPU indices on that node."""

    @property
    def num_gpus(self) -> int:
        return sum(len(g) for g in self.gpus.values())


class Job(BaseModel):
    """One distillation job (a recipe) as the planner sees it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    recipe: str = ""
    """Path of the distillation recipe this job runs (passed to ``accelerate launch -m distill``)."""
    student_params_b: float = Field(default=0.135, gt=0)
    """Trainable (student) parameters, billions: sets memory fit and ZeRO stage."""
    teacher_params_b: float = Field(default=0.0, ge=0)
    """Frozen teacher parameters, billions (0 when teacher and student share weights, as in SwiftKV)."""
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    """The recipe's ``train.mixed_precision``: a bf16 job only fits GPU types with ``bf16: true``."""
    config_json: str | None = None
    """The recipe's model ``config.json`` when ``model.source`` is not on the planning machine (e.g.
    ``recipes/model_configs/llama3.1_8b/config.json``)."""
    activation_gb: float | None = Field(default=None, ge=0)
    """Unset (the default): the job's per-GPU memory is ``distill check``'s estimate for its recipe.  Set: model
    states by bytes per parameter plus this much for activations (jobs without a recipe, synthetic traces)."""
    max_gpus: int = Field(default=64, ge=1)
    """Largest useful number of GPUs (global batch / smallest micro-batch)."""
    preemptible: bool = True
    """False: a running job keeps its current allocation."""
    restart_s: float = Field(default=60.0, ge=0)
    """Seconds lost when the job is restarted on another allocation (checkpoint-restart)."""
    age_s: float = Field(default=0.0, ge=0)
    """Seconds since the job was submitted (restart factor)."""
    restarts: int = Field(default=0, ge=0)
    """Restarts so far (restart factor)."""
    current: Placement | None = None
    """Where the job runs now, if it runs."""
    observed: list[Observation] = Field(default_factory=list)
    """Measured throughputs: 1-GPU profiles per type plus any larger runs."""

    @model_validator(mode="after")
    def _memory_source(self) -> Job:
        if not self.recipe and self.activation_gb is None:
            raise ValueError(
                f"job {self.name!r} has neither a recipe (memory from the `distill check` estimate) nor "
                "activation_gb; to resolve, give its recipe path"
            )
        return self


class JobList(BaseModel):
    """``jobs.yaml``: the jobs to place."""

    model_config = ConfigDict(extra="forbid")

    jobs: list[Job] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> JobList:
        _require_unique([j.name for j in self.jobs], "job")
        return self


def _one_line(path: Path | str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<file>"
        parts.append(f"{loc}: {e['msg']}")
    return f"{path}: " + "; ".join(parts) + " (to resolve, fix these fields; examples in recipes/cluster/)"


def _load(path: Path | str, model: type[BaseModel], what: str) -> BaseModel:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; to resolve, pass the path of a {what} YAML")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(
            f"{path}: not valid YAML ({str(e).splitlines()[0]}); to resolve, fix the syntax"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: empty or not a mapping; to resolve, see recipes/cluster/ for a {what} example"
        )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ValueError(_one_line(path, e)) from None


def load_cluster(path: Path | str) -> Cluster:
    """Read and validate ``cluster.yaml`` (a file or a shipped name, ``distill.shipped``)."""
    return _load(find(path, "cluster file"), Cluster, "cluster")  # type: ignore[return-value]


def load_jobs(path: Path | str, cluster: Cluster) -> JobList:
    """Read ``jobs.yaml`` (a file or a shipped name) and check that every GPU type it names exists in
    ``cluster``."""
    path = find(path, "cluster file")
    jobs: JobList = _load(path, JobList, "jobs")  # type: ignore[assignment]
    valid = {t.name for t in cluster.gpu_types}
    owner: dict[tuple[str, int, int], str] = {}
    for job in jobs.jobs:
        named = {o.gpu_type for o in job.observed} | ({job.current.gpu_type} if job.current else set())
        if named - valid:
            raise ValueError(
                f"{path}: job {job.name!r} names GPU types {sorted(named - valid)} not in the cluster "
                f"{sorted(valid)}; to resolve, use the cluster's type names"
            )
        for node, gpus in job.current.gpus.items() if job.current else []:
            gpu = cluster.type(job.current.gpu_type)
            for g in gpus:
                cell = (gpu.name, node, g)
                if not (0 <= node < gpu.nodes and 0 <= g < gpu.gpus_per_node) or cell in owner:
                    why = f"also used by {owner[cell]!r}" if cell in owner else "outside the cluster"
                    raise ValueError(
                        f"{path}: job {job.name!r} current GPU {g} of {gpu.name} node {node} is {why}; "
                        "to resolve, give each running job its own GPUs"
                    )
                owner[cell] = job.name
    return jobs
