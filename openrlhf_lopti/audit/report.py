"""The audit's outputs: the JSON (NaN written as null), the printed table and the PNG."""

import json
import math
import os


def _clean(value):
    """JSON-safe copy: NaN / inf floats become None, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(result: dict, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(_clean(result), f, indent=2)
        f.write("\n")


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(result: dict) -> str:
    """Markdown table: one row per probability bin, lowest first."""
    edges = result["bin_edges"]
    methods = list(result["correct_direction_by_quartile"])
    params = result.get("param_grad_norm_by_quartile")
    head = ["bin", "p range", "tokens", "A>0 tokens", "|grad| logits"]
    head += ["|grad| params"] if params else []
    head += [f"up: {m}" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in range(4):
        cells = [
            f"Q{k + 1}",
            f"[{edges[k]:.2f}, {edges[k + 1]:.2f}{']' if k == 3 else ')'}",
            str(result["token_count_by_quartile"][k]),
            str(result["positive_count_by_quartile"][k]),
            _fmt(result["grad_norm_by_quartile"][k], ".4f"),
        ]
        if params:
            cells.append(_fmt(params[k], ".4f"))
        cells += [_fmt(result["correct_direction_by_quartile"][m][k], ".3f") for m in methods]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str | os.PathLike) -> None:
    """Left: mean gradient norm per bin (logits; parameters on the right axis). Right: fraction of
    positive-advantage tokens whose probability rose, per method and bin (0.5 = chance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = result["bin_edges"]
    labels = [f"[{edges[k]:.2f},{edges[k + 1]:.2f}]" for k in range(4)]
    nan = float("nan")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = list(range(4))
    grads = [nan if v is None else v for v in result["grad_norm_by_quartile"]]
    ax1.bar([i - 0.2 for i in x], grads, width=0.4, label="w.r.t. logits", color="tab:blue")
    ax1.set_ylabel("mean |grad| w.r.t. logits")
    params = result.get("param_grad_norm_by_quartile")
    if params:
        twin = ax1.twinx()
        twin.bar([i + 0.2 for i in x], [nan if v is None else v for v in params], width=0.4, color="tab:orange",
                 label="w.r.t. parameters")  # fmt: skip
        twin.set_ylabel("mean |grad| w.r.t. parameters")
        handles = ax1.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        twin.legend(handles=handles, loc="upper right")
    else:
        ax1.legend(loc="upper right")
    ax1.set_xticks(x, labels)
    ax1.set_xlabel("token probability bin (sampling policy)")
    ax1.set_title("per-token gradient norm (paper Fig. 1d)")

    methods = list(result["correct_direction_by_quartile"])
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        vals = [nan if v is None else v for v in result["correct_direction_by_quartile"][m]]
        ax2.bar([i - 0.4 + width * (j + 0.5) for i in x], vals, width=width, label=m)
    ax2.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    ax2.set_ylim(0, 1)
    ax2.set_xticks(x, labels)
    ax2.set_xlabel("token probability bin (sampling policy)")
    ax2.set_ylabel("fraction of A>0 tokens whose p rose")
    ax2.set_title("updated in the right direction after one step (paper Fig. 3)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
