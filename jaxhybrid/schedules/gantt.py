"""The one Gantt plotter: devices (rows, top to bottom) x time, a bar per piece of work.

`Schedule.plot` (pipeline task tables, and plans through them) and `BurstPlan.plot`
(layers over device groups) build their bars and draw them here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class Bar:
    """Work from `start` for `length` (any time unit) on rows [device, device + rows)."""
    start: float
    length: float
    device: float
    color: Any
    rows: float = 1.0
    label: str = ""
    alpha: float = 1.0
    edge: bool = True


def draw(path: str, bars: Sequence[Bar], num_devices: int, *, title: str, xlabel: str,
         width: float | None = None, gap: float = 0.1, dpi: int = 110) -> None:
    """Writes a PNG of `bars` to `path`; `gap` leaves space between the rows of
    neighbouring devices (0: groups of devices draw as one block)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    end = max((b.start + b.length for b in bars), default=1.0)
    fig, ax = plt.subplots(figsize=(width or 10, 0.5 * num_devices + 1.3))
    for b in bars:
        ax.add_patch(Rectangle((b.start, b.device + gap), b.length, b.rows - 2 * gap,
                               facecolor=b.color, alpha=b.alpha, linewidth=0.4 if b.edge else 0,
                               edgecolor="k" if b.edge else b.color))
        if b.label:
            ax.text(b.start + b.length / 2, b.device + b.rows / 2, b.label, ha="center",
                    va="center", fontsize=6)
    ax.set_xlim(0, end)
    ax.set_ylim(num_devices, 0)                     # device 0 on top
    ax.set_yticks([d + 0.5 for d in range(num_devices)],
                  [f"device {d}" for d in range(num_devices)])
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
