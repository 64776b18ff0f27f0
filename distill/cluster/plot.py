"""Figure of a simulator comparison: JCT distribution per policy and GPUs in use over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .simulator import SimResult


def plot_results(results: list[SimResult], path: Path | str) -> None:
    """Write a two-panel PNG: CDF of job completion time, and allocated GPUs per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, use) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        jct = np.sort(np.array(list(r.jct.values())) / 3600)
        cdf.plot(
            jct, np.arange(1, len(jct) + 1) / max(len(jct), 1), label=f"{r.policy} (avg {jct.mean():.2f} h)"
        )
        t = np.array([u[0] for u in r.usage]) / 3600
        use.plot(t, [sum(u[1].values()) for u in r.usage], label=r.policy, lw=1)
    cdf.set(xscale="log", xlabel="job completion time (h)", ylabel="fraction of jobs", title="JCT CDF")
    use.set(xlabel="time (h)", ylabel="GPUs allocated", title="cluster usage")
    cdf.legend(), use.legend()
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
