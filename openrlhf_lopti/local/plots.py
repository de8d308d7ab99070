"""PNG training curves: reward, accuracy, KL to the reference and low-probability token fraction per step."""

import os
from typing import Optional

PANELS = (
    ("reward", "reward (paper rule, [-3, 3])"),
    ("accuracy", "accuracy (all roles right)"),
    ("kl", "KL(policy || reference), k3"),
    ("low_token_fraction", "fraction of tokens with p < eta"),
)
# Added when the rows have them (--track-direction): paper Fig. 3 per step, lowest and highest bin.
DIRECTION_PANELS = (
    ("direction/pos_up_q1", "A>0 tokens, p in [0, .25): share whose p rose"),
    ("direction/pos_up_q4", "A>0 tokens, p in [.75, 1]: share whose p rose"),
)


def smooth(values: list, window: int) -> list:
    """Trailing moving average over ``window`` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: dict, path: str | os.PathLike, title: Optional[str] = None, window: int = 0) -> None:
    """Draw the four panels (six with direction metrics) for one or several runs into one PNG.

    Args:
        runs: ``{label: metrics rows}`` (rows as in metrics.jsonl; missing keys are skipped).
        path: output PNG.
        title: figure title.
        window: moving-average window in steps; 0 picks about a tenth of the run (at least 1).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed (and none on CI)
    import matplotlib.pyplot as plt

    panels = PANELS
    if any(key in r for rows in runs.values() for r in rows for key, _ in DIRECTION_PANELS):
        panels = PANELS + DIRECTION_PANELS
    columns = len(panels) // 2
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 7))
    for ax, (key, label) in zip(axes.flat, panels):
        for name, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if key in r]
            if not points:
                continue
            steps, values = zip(*points)
            w = window or max(1, len(values) // 10)
            ax.plot(steps, smooth(list(values), w), label=name)
        if key.startswith("direction/"):
            ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)  # chance
        ax.set_title(label)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
