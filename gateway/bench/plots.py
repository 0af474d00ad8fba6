"""PNG plots of `specstream bench serve` reports: latency CDFs, throughput and speedup vs
concurrency, acceptance per draft position (matplotlib, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path


def plot(reports: list[dict], out_dir: Path) -> list[Path]:
    """Write the plots the reports have data for; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("latency_cdf.png", _latency_cdfs),
        ("throughput.png", _throughput),
        ("acceptance.png", _acceptance),
    ):
        fig = draw(plt, reports)
        if fig is None:
            continue
        fig.tight_layout()
        written.append(out_dir / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def _prompt_sets(reports: list[dict]) -> list[str]:
    return sorted({run["prompt_set"] for rep in reports for run in rep["runs"]})


def _latency_cdfs(plt, reports: list[dict]):
    sets = _prompt_sets(reports)
    fig, axes = plt.subplots(len(sets), 2, figsize=(11, 4 * len(sets)), squeeze=False)
    for row, name in enumerate(sets):
        for col, key in enumerate(("ttft_s", "itl_s")):
            ax = axes[row][col]
            for rep in reports:
                for run in rep["runs"]:
                    if run["prompt_set"] != name or not run[key]:
                        continue
                    values = sorted(v * 1000 for v in run[key])
                    level = run.get("concurrency", run.get("rate"))
                    fractions = [(i + 1) / len(values) for i in range(len(values))]
                    ax.plot(values, fractions, label=f"{rep['label']} @{level}")
            ax.set_xlabel(("TTFT" if key == "ttft_s" else "inter-chunk latency") + " (ms)")
            ax.set_ylabel("fraction of requests" if key == "ttft_s" else "fraction of chunks")
            ax.set_xscale("log")
            ax.set_title(f"{name}: {'TTFT' if key == 'ttft_s' else 'ITL'} CDF")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return fig


def _throughput(plt, reports: list[dict]):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for rep in reports:
        for name in _prompt_sets(reports):
            runs = [r for r in rep["runs"] if r["prompt_set"] == name and "concurrency" in r]
            runs.sort(key=lambda r: r["concurrency"])
            if not runs:
                continue
            xs = [r["concurrency"] for r in runs]
            ys = [r["summary"]["throughput_tok_s"] or 0 for r in runs]
            axes[0].plot(xs, ys, marker="o", label=f"{rep['label']} {name}")
            axes[1].plot(xs, [y / ys[0] if ys[0] else 0 for y in ys], marker="o", label=f"{rep['label']} {name}")
    axes[0].set_title("throughput vs concurrency")
    axes[0].set_ylabel("tokens/s")
    axes[1].set_title("speedup vs its own concurrency-1 throughput")
    axes[1].set_ylabel("x")
    for ax in axes:
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def _acceptance(plt, reports: list[dict]):
    """Only against servers that expose specstream's spec-decode metrics."""
    accepted = [(rep["label"], run) for rep in reports for run in rep["runs"] if run.get("acceptance")]
    if not accepted:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, run in accepted:
        per = run["acceptance"]["per_position"]
        level = run.get("concurrency", run.get("rate"))
        ax.plot(range(1, len(per) + 1), per, marker="o", label=f"{label} {run['prompt_set']} @{level}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | round drafted)")
    ax.set_title("acceptance per draft position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
