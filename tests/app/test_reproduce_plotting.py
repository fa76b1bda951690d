"""The reproduction's bar charts (``convex_eq_app/reproduce/plotting.py``): the table's long model
names stay readable and each mean is written clear of its error bar, measured on the drawn
figure."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

from convex_eq_app.reproduce import plotting
from convex_eq_app.reproduce.power import Stat

LABELS = ["POptEq", "MOptEq (paper's D)", "MOptEq (smoothed D)", "MOptEq (smoothed D) + PE",
          "H only (−D)"]


def test_long_model_names_on_a_bar_chart_do_not_overlap(tmp_path: Path) -> None:
    fig, axes = plotting.figure(2, width=4.5)
    stats = [Stat.of([0.95 + 0.002 * i, 0.96]) for i in range(len(LABELS))]
    plotting.bars(axes[0], LABELS, stats)
    plotting.bars(axes[1], LABELS[2:4], stats[2:4])
    axes[1].set_ylabel("accuracy under the derived δ, ε = 0.1 (%)")
    fig.tight_layout()  # as plotting.save lays the figure out before writing it
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
        assert len(boxes) >= 2
        for a, b in combinations(boxes, 2):
            assert not a.overlaps(b), (a, b)
    assert plotting.save(fig, tmp_path, "bars.png", "t") == "bars.png"
    assert (tmp_path / "bars.png").stat().st_size > 5_000


def test_each_mean_is_written_above_its_error_bar(tmp_path: Path) -> None:
    """The label of a bar whose error bar reaches above the bar (a spread of 1 point) starts
    above the error bar's top, measured in display coordinates."""
    fig, axes = plotting.figure(1, width=4.5)
    stats = [Stat.of([0.95, 0.97]), Stat.of([0.96, 0.961])]
    plotting.bars(axes[0], LABELS[:2], stats)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in axes[0].texts if t.get_text() in ("96.0", "96.1")]
    assert len(texts) == 2
    for x, (s, t) in enumerate(zip(stats, texts)):
        assert t.get_text() == f"{100 * s.mean:.1f}"
        top = axes[0].transData.transform((x, 100 * (s.mean + s.std)))[1]
        assert t.get_window_extent(renderer).y0 >= top
