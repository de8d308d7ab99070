"""PNG training curves: reward, accuracy, KL to the reference and low-probability token fraction per step."""

import math
import os
from typing import Optional

PANELS = (
    ("reward", "reward (K&K: paper rule, [-3, 3])"),
    ("accuracy", "accuracy (K&K: all roles right; else mean score)"),
    ("kl", "KL(policy || reference), k3"),
    ("lopti/low_token_frac", "fraction of tokens with p < the Lopti threshold"),
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


def panels_for(runs: dict) -> list:
    """``(metric, title)`` of every panel: the four base ones, the direction ones when logged, and one per
    ``reward/<name>`` metric (a reward file's ``extra_logs``)."""
    keys = {key for rows in runs.values() for r in rows for key in r}
    panels = list(PANELS)
    if any(key in keys for key, _ in DIRECTION_PANELS):
        panels += DIRECTION_PANELS
    panels += [(key, f"reward file's extra_logs: {key[len('reward/') :]}") for key in sorted(keys)
               if key.startswith("reward/")]  # fmt: skip
    return panels


def plot_runs(runs: dict, path: str | os.PathLike, title: Optional[str] = None, window: int = 0) -> None:
    """Draw the panels of :func:`panels_for` for one or several runs into one PNG.

    Args:
        runs: ``{label: metrics rows}`` (rows as in metrics.jsonl; missing keys are skipped).
        path: output PNG.
        title: figure title.
        window: moving-average window in steps; 0 picks about a tenth of the run (at least 1).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed (and none on CI)
    import matplotlib.pyplot as plt

    panels = panels_for(runs)
    columns = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 7), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
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
