"""Small matplotlib helpers shared by the experiments' plots (Agg backend, PNG files)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .registry import Stat


def figure(ncols: int = 1, width: float = 5.0, height: float = 3.6) -> tuple[Any, Any]:
    """A figure with ``ncols`` axes (a list even for one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(ax[0])


def save(fig: Any, out: Path, name: str, title: str) -> str:
    """Write ``out/name`` (120 dpi) with a suptitle; returns the file name."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(out) / name, dpi=120)
    plt.close(fig)
    return name


def errorbar(ax: Any, xs: Sequence[float], stats: Sequence[Stat], label: str,
             scale: float = 1.0, **kw: Any) -> None:
    """Means with ±1 sample standard deviation (over seeds) as error bars."""
    ax.errorbar(list(xs), [scale * s.mean for s in stats], yerr=[scale * s.std for s in stats],
                marker="o", ms=4, capsize=3, label=label, **kw)


def bars(ax: Any, labels: Sequence[str], stats: Sequence[Stat], scale: float = 100.0) -> None:
    """A bar per label with ±1 std error bars and the mean written above its error bar."""
    xs = range(len(labels))
    bar = ax.bar(xs, [scale * s.mean for s in stats], yerr=[scale * s.std for s in stats],
                 capsize=3, color="0.75", edgecolor="0.3")
    # bar_label puts each mean beyond the end of its error bar, where no cap crosses it
    ax.bar_label(bar, labels=[f"{scale * s.mean:.1f}" for s in stats], padding=2, fontsize=7)
    # model names are long ("MOptEq (smoothed D) + PE"): wrapped upright, they do not collide
    ax.set_xticks(list(xs), [textwrap.fill(t, 10) for t in labels], fontsize=7)
    lo = min(scale * (s.mean - s.std) for s in stats)
    hi = max(scale * (s.mean + s.std) for s in stats)
    pad = max(1.0, 0.15 * (hi - lo))
    ax.set_ylim(max(0.0, lo - pad), hi + pad)
