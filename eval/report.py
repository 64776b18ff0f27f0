"""``report.md`` and PNG plots from a run's ``run.json`` (variant x quality x speed x KV memory, and each
variant's held-out quality against tokens trained).

Every number in the report is read from run.json, which the run that measured it wrote; the report lists
the commands of that run.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distill.runs import read_curve  # noqa: E402
from toolkit.artifacts import save_figure, write_text_atomic  # noqa: E402


def _fmt(value, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def table(run: dict) -> list[str]:
    lengths = run["meta"]["prefill_lengths"]
    n = lengths[-1]
    lines = [
        f"| variant | SwiftKV layers | KL all prompt, before → after | top-1 agree | ppl student (teacher) | greedy prefix agree "
        f"| prefill x @{n} (FLOP-ideal) | decode ratio | KV B/token | sharegpt_mc acc | sharegpt ppl (word) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in run["variants"]:
        q, before, speed, lm = (
            v.get("quality") or {},
            v.get("quality_before") or {},
            v.get("speed") or {},
            v.get("lm_eval") or {},
        )
        kl = f"{_fmt(before.get('kl'))} → {_fmt(q.get('kl'))}" if before else _fmt(q.get("kl"))
        prefill = f"{_fmt(speed.get('prefill_speedup', {}).get(str(n)), '.2f')}x ({_fmt(v['ideal_prefill_speedup'].get(str(n)), '.2f')}x)"
        lines.append(
            f"| {v['name']} | {v['swiftkv_layers']}/{v['num_layers']} | {kl} | {_fmt(q.get('top1_agreement'))} "
            f"| {_fmt(q.get('ppl_student'), '.2f')} ({_fmt(q.get('ppl_teacher'), '.2f')}) "
            f"| {_fmt(q.get('greedy_prefix_agreement'), '.2f')} | {prefill} | {_fmt(speed.get('decode_ratio'), '.3f')} "
            f"| {v['kv_bytes_per_token']} | {_fmt(lm.get('sharegpt_mc', {}).get('acc'), '.2f')} "
            f"| {_fmt(lm.get('sharegpt_ppl', {}).get('word_perplexity'), '.2f')} |"
        )
    return lines


SERVED_SUBSETS = {
    "reply": "reply tokens",
    "first16": "first 16 of each reply",
    "first_reply": "first reply",
}


def served_table(run: dict) -> list[str]:
    """Each SwiftKV variant's KL (and perplexity ratio) as served beside the all-prompt number (``eval.quality``)."""
    rows = [v for v in run["variants"] if (v.get("quality") or {}).get("served")]
    if not rows:
        return []
    lines = [
        "| variant | exact K/V W | KL all prompt | "
        + " | ".join(f"KL as served, {label}" for label in SERVED_SUBSETS.values())
        + " | ppl ratio as served | top-1 as served |",
        "|---|---|---|" + "---|" * len(SERVED_SUBSETS) + "---|---|",
    ]
    for v in rows:
        q = v["quality"]
        served = q["served"]
        cells = [_fmt((served.get(k) or {}).get("kl")) for k in SERVED_SUBSETS]
        reply = served["reply"]
        lines.append(
            f"| {v['name']} | {q.get('exact_kv_window') or 'off'} | {_fmt(q.get('kl'))} | "
            + " | ".join(cells)
            + f" | ×{reply['ppl_student'] / reply['ppl_teacher']:.3f} | {_fmt(reply['top1_agreement'])} |"
        )
    return lines


def _heavy(v: dict) -> dict:
    return (v.get("quality") or {}).get("prompt_heavy") or {}


def prompt_heavy_table(run: dict) -> list[str]:
    """Each SwiftKV variant after long prompts, as served (``eval.prompt_heavy``): KL [95% interval] and
    perplexity ratio per prompt-length band, the document set, and retrieval accuracy against the teacher's."""
    rows = [v for v in run["variants"] if _heavy(v)]
    if not rows:
        return []
    bands = list(_heavy(rows[0])["bands"])
    lines = [
        "| variant | prefill x (FLOP-ideal) | "
        + " | ".join(f"prompt {b} tokens: KL [95%], ppl ratio (replies)" for b in bands)
        + " | documents: KL [95%], ppl ratio (docs) |",
        "|---|---|" + "---|" * (len(bands) + 1),
    ]

    def cell(m: dict) -> str:
        if not m.get("tokens"):
            return "– (0)"
        lo, hi = m["kl_ci95"]
        return f"{m['kl']:.3f} [{lo:.3f}, {hi:.3f}], ×{m['ppl_ratio']:.3f} ({m['samples']})"

    for v in rows:
        h = _heavy(v)
        n = str(run["meta"]["prefill_lengths"][-1])
        speed = (v.get("speed") or {}).get("prefill_speedup", {}).get(n)
        prefill = f"{_fmt(speed, '.2f')}x ({v['ideal_prefill_speedup'].get(n, 0):.2f}x)"
        lines.append(
            f"| {v['name']} | {prefill} | "
            + " | ".join(cell(h["bands"][b]) for b in bands)
            + f" | {cell(h['documents'])} |"
        )
    retrieval = _heavy(rows[0]).get("retrieval") or {}
    if retrieval:
        cols = [(task, n) for task, by_len in retrieval.items() for n in by_len]
        lines += [
            "",
            "Retrieval accuracy (greedy, as served; samples per cell in parentheses):",
            "",
            "| model | " + " | ".join(f"{task} @{n}" for task, n in cols) + " |",
            "|---|" + "---|" * len(cols),
            "| teacher | "
            + " | ".join(f"{retrieval[t][n]['teacher']:.2f} ({retrieval[t][n]['samples']})" for t, n in cols)
            + " |",
        ]
        for v in rows:
            r = _heavy(v)["retrieval"]
            lines.append(
                f"| {v['name']} | " + " | ".join(f"{r[t][n]['student']:.2f}" for t, n in cols) + " |"
            )
    return lines


# the targets a prompt-heavy deployment holds a variant to, as served (docs/eval.md, "Prompt-heavy quality")
TARGETS = {
    "ShareGPT reply KL": 0.08,
    "ShareGPT first-16 KL": 0.12,
    "ShareGPT ppl ratio": 1.08,
    "1-2k prompt KL": 0.10,
    "1-2k prompt ppl ratio": 1.10,
    "documents KL": 0.10,
    "retrieval points below the teacher": 0.02,
}


def target_misses(v: dict) -> list[str]:
    """The ``TARGETS`` a variant misses (retrieval counted where the teacher scores >= 50%); [] holds all."""
    q, h = v.get("quality") or {}, _heavy(v)
    served = q.get("served") or {}
    band = h.get("bands", {}).get("1024-2048", {})
    docs = h.get("documents", {})
    gaps = [
        r["teacher"] - r["student"]
        for by_len in h.get("retrieval", {}).values()
        for r in by_len.values()
        if r["teacher"] >= 0.5
    ]
    reply = served.get("reply", {})
    values = {
        "ShareGPT reply KL": reply.get("kl"),
        "ShareGPT first-16 KL": served.get("first16", {}).get("kl"),
        "ShareGPT ppl ratio": reply["ppl_student"] / reply["ppl_teacher"] if reply else None,
        "1-2k prompt KL": band.get("kl"),
        "1-2k prompt ppl ratio": band.get("ppl_ratio"),
        "documents KL": docs.get("kl"),
        "retrieval points below the teacher": max(gaps) if gaps else None,
    }
    return [
        f"{name} {value:.3f} > {TARGETS[name]}"
        for name, value in values.items()
        if value is not None and value > TARGETS[name]
    ]


def choice_lines(run: dict) -> list[str]:
    """Which variants hold the prompt-heavy targets, and the largest fraction that does."""
    rows = [v for v in run["variants"] if _heavy(v)]
    if not rows:
        return []
    lines = [f"Targets as served: {', '.join(f'{k} ≤ {t}' for k, t in TARGETS.items())}.", ""]
    holding = []
    for v in rows:
        misses = target_misses(v)
        lines.append(
            f"* {v['name']}: " + ("holds every target" if not misses else "misses " + "; ".join(misses))
        )
        if not misses:
            holding.append(v)
    best = max(holding, key=lambda v: v["swiftkv_layers"], default=None)
    lines += [
        "",
        f"Largest fraction that holds them: **{best['name']}** ({best['swiftkv_layers']}/{best['num_layers']} "
        "layers skipped by prompt tokens)."
        if best
        else "No variant holds every target.",
    ]
    return lines


def prompt_heavy_plot(run: dict, out: Path) -> Path | None:
    """KL as served against prompt length (ShareGPT replies under 512 tokens, then each band), per variant."""
    rows = [v for v in run["variants"] if _heavy(v)]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for v in rows:
        bands = _heavy(v)["bands"]
        points = [(256, v["quality"]["served"]["reply"]["kl"])]
        for band, m in bands.items():
            if m.get("tokens"):
                lo, hi = map(int, band.split("-"))
                points.append(((lo * hi) ** 0.5, m["kl"]))
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=v["name"])
    ax.set(
        xscale="log",
        xlabel="prompt tokens before the reply (band centre)",
        ylabel="KL as served (teacher || student)",
        title="Quality against prompt length",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out / "quality_vs_prompt_length.png")


def plots(run: dict, out: Path) -> list[Path]:
    lengths = run["meta"]["prefill_lengths"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for v in run["variants"]:
        speed = v.get("speed") or {}
        if speed.get("prefill_s"):
            ax.plot(
                lengths, [speed["prefill_s"][str(n)] * 1000 for n in lengths], marker="o", label=v["name"]
            )
    ax.set(xlabel="prompt tokens", ylabel="prefill ms (median)", title="Prefill time vs prompt length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    prefill_png = save_figure(fig, out / "prefill_vs_length.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    n = str(lengths[-1])
    for v in run["variants"]:
        q, speed = v.get("quality") or {}, v.get("speed") or {}
        if "kl" in q and speed.get("prefill_speedup"):
            ax.scatter(speed["prefill_speedup"][n], q["top1_agreement"], label=v["name"])
            if v.get("quality_before"):
                ax.scatter(
                    speed["prefill_speedup"][n],
                    v["quality_before"]["top1_agreement"],
                    marker="x",
                    color="gray",
                )
    ax.set(
        xlabel=f"measured prefill speedup @{n} tokens",
        ylabel="top-1 agreement with teacher",
        title="Quality vs prefill savings (x = before distillation)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    quality_png = save_figure(fig, out / "quality_vs_prefill.png")
    heavy_png = prompt_heavy_plot(run, out)
    return [prefill_png, quality_png, *([heavy_png] if heavy_png else [])]


def _ppl_ratio(record: dict) -> float:
    return record["eval_ppl_student"] / record["eval_ppl_teacher"]


def curve_table(curves: dict[str, list[dict]]) -> list[str]:
    lines = [
        "| run | step | tokens trained | held-out KL | top-1 agree | ppl student / teacher |",
        "|---|---|---|---|---|---|",
    ]
    for name, points in curves.items():
        for r in points:
            lines.append(
                f"| {name} | {r['step']} | {r['train_tokens']:,} | {r['eval_kl']:.3f} "
                f"| {r['eval_top1_agreement']:.3f} | {r['eval_ppl_student']:.2f} / {r['eval_ppl_teacher']:.2f} "
                f"(×{_ppl_ratio(r):.3f}) |"
            )
    return lines


def curve_plot(curves: dict[str, list[dict]], path: Path) -> Path:
    """Held-out KL and perplexity ratio against tokens trained, one line per run."""
    fig, (kl_ax, ppl_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, points in curves.items():
        tokens = [r["train_tokens"] / 1000 for r in points]
        kl_ax.plot(tokens, [r["eval_kl"] for r in points], marker="o", markersize=3, label=name)
        ppl_ax.plot(tokens, [_ppl_ratio(r) for r in points], marker="o", markersize=3, label=name)
    kl_ax.set(xlabel="thousand tokens trained", ylabel="held-out KL (teacher || student)", yscale="log")
    ppl_ax.set(xlabel="thousand tokens trained", ylabel="perplexity student / teacher")
    kl_ax.legend(fontsize=7)
    fig.suptitle("Distillation: held-out quality vs tokens trained", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def write_report(run_dir: str | Path, curve_runs: list[str | Path] = ()) -> Path:
    """Write ``report.md`` and the PNGs into ``run_dir`` from its ``run.json``; return the report path.

    ``curve_runs``: output folders of longer distillations (``recipes/swiftkv_smollm2_cpu_curve.yaml``) whose
    held-out curves are drawn beside the job's own, so the report shows where more training stops paying."""
    run_dir = Path(run_dir)
    path = run_dir / "run.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; to resolve, run the main job (swiftkv run --out {run_dir}) first"
        )
    run = json.loads(path.read_text())
    curves = {
        f"{v['name']} (this job)": v["distill"]["curve"]
        for v in run["variants"]
        if (v.get("distill") or {}).get("curve")
    }
    curves.update({f"{Path(d).name} (longer run)": read_curve(d) for d in curve_runs})  # before any output
    pngs = plots(run, run_dir)
    curve_lines = []
    if curves:
        png = curve_plot(curves, run_dir / "quality_vs_tokens.png")
        curve_lines = [
            "## Held-out quality vs tokens trained",
            "",
            f"![{png.stem}]({png.name})",
            "",
            "On each distillation's train-side holdout (the recipe's `data.holdout`), not the evaluation split above.",
            "",
            *curve_table(curves),
            "",
            *[f"Longer run: `{Path(d) / 'log.jsonl'}`." for d in curve_runs],
            "",
        ]
    meta = run["meta"]
    lines = [
        f"# SwiftKV report: {meta['model']}",
        "",
        f"Measured on {meta['machine']} ({meta['dtype']}), {meta['date']}."
        " Speed: medians of interleaved repeats, ratios against the original measured in the same run."
        " Quality: held-out ShareGPT conversations against each checkpoint's own teacher (the original weights).",
        "",
        *table(run),
        "",
        "Quality as served: each reply scored with everything before it as prompt and only that reply as "
        "generated (a request without a prefix-cache hit), so exactly the tokens a server runs through every "
        "layer (the reply, and with exact K/V the last W prompt tokens) take exact K/V; all prompt: every "
        "position as a prompt token, the conservative number.",
        "",
        *served_table(run),
        "",
        *(
            [
                "## Prompt-heavy quality",
                "",
                "Replies after long prompts (held-out ShareGPT, the first 64 tokens of each reply, one reply per "
                "conversation), documents Python ships with an instruction (the teacher's own greedy reply scored) "
                "and synthetic retrieval, all as served against the teacher; 95% intervals by bootstrap over "
                "replies.",
                "",
                *prompt_heavy_table(run),
                "",
                *choice_lines(run),
                "",
            ]
            if prompt_heavy_table(run)
            else []
        ),
        *[f"![{p.stem}]({p.name})" for p in pngs],
        "",
        *curve_lines,
        "## Commands",
        "",
        *[f"    {c}" for c in run["commands"]],
        "",
    ]
    return write_text_atomic(run_dir / "report.md", "\n".join(lines))
