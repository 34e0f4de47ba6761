"""Pictures of a sweep (PNG, matplotlib's Agg backend: no display needed).

Contract:
- `plot_tradeoff(levels, path)`: two panels, output tokens/s against TTFT and against TPOT, one point per sweep level
  (median as a solid line, p99 dashed), each point labelled with its level — the latency/throughput trade-off.
- `plot_cdf(levels, path)`: empirical CDFs of TTFT, TPOT and end-to-end latency, one line per level.
- `levels` is the `levels` list of the results JSON (each with `label`, `summary` and `requests`), so plots can be
  redrawn from a saved file. Both functions return the path written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def plot_tradeoff(levels: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    thr = [lv["summary"]["output_throughput"] for lv in levels]
    for ax, metric, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "time per output token")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            xs = [lv["summary"][metric][stat] for lv in levels]
            pts = [(x, y) for x, y in zip(xs, thr, strict=True) if x is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=stat)
        for lv, y in zip(levels, thr, strict=True):
            x = lv["summary"][metric]["median"]
            if x is not None:
                ax.annotate(lv["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"throughput vs {name}")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", label=label)


def plot_cdf(levels: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, name in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "end-to-end"), strict=True):
        for lv in levels:
            values = [r[key] for r in lv["requests"] if r["status"] == "OK" and r[key] is not None]
            _cdf(ax, values, lv["label"])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
