"""The loss-head benchmark from a source checkout: ``openrlhf_lopti/cli/bench_loss_head.py`` is the program
(``openrlhf-lopti bench``; ``check-gpu`` runs it too, so it ships with the package). Same flags, same JSON, written
under ``benchmarks/results/`` by default.

    python -m benchmarks.bench_policy_loss                       # GPU: N=16384, V=151936, bf16
    python -m benchmarks.bench_policy_loss --device cpu          # CPU: N=256, V=4096
    python benchmarks/bench_policy_loss.py --help
"""

import sys
from typing import Optional

from openrlhf_lopti.cli import bench_loss_head
from openrlhf_lopti.cli.bench_loss_head import (  # noqa: F401  (the names this script defined before the move)
    ALL_BACKENDS,
    DTYPES,
    GOALS,
    OURS,
    PEAK_BANDWIDTH,
    RESULTS_DIR,
    Config,
    format_table,
    make_inputs,
    peak_bandwidth,
    required_bytes,
    run_backend,
    summarize,
)


def main(argv: Optional[list] = None) -> int:
    """:func:`openrlhf_lopti.cli.bench_loss_head.main` under this script's name."""
    return bench_loss_head.main(argv, prog="bench_policy_loss")


if __name__ == "__main__":
    sys.exit(main())
