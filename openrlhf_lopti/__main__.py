"""``openrlhf-lopti <command>`` / ``python -m openrlhf_lopti <command>``.

Each command lives in its own module and is imported only when run, so ``--help`` stays fast.
"""

import importlib
import os
import sys
from typing import Optional

# command -> (module with a `main(argv) -> int`, one-line help)
COMMANDS = {
    "demo": ("openrlhf_lopti.local.demo", "tiny model, warm-up, then GRPO / +AR / +Lopti / +AR+Lopti side by side"),
    "train": ("openrlhf_lopti.local.cli", "one-process GRPO / REINFORCE++ trainer with AR and Lopti"),
    "audit": ("openrlhf_lopti.audit.cli", "token-probability diagnostics (paper Fig. 1d and Fig. 3)"),
    "eval": ("openrlhf_lopti.tasks.evaluate", "accuracy of generations per K&K size / math benchmark"),
    "data": ("openrlhf_lopti.tasks.data", "write OpenRLHF prompt datasets (K&K, math)"),
    "bench": ("benchmarks.bench_policy_loss", "benchmark the fused policy loss against OpenRLHF's path"),
}


def usage() -> str:
    lines = ["usage: openrlhf-lopti <command> [options]", "", "commands:"]
    lines += [f"  {name:<7} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`openrlhf-lopti <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"openrlhf-lopti: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    if module_name.startswith("benchmarks."):
        # benchmarks/ sits beside the package in a source checkout and is not installed with it.
        repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if not os.path.isdir(os.path.join(repo_root, "benchmarks")):
            print("openrlhf-lopti: `bench` needs a source checkout (benchmarks/ beside the package)", file=sys.stderr)
            return 2
        sys.path.insert(0, repo_root)
    module = importlib.import_module(module_name)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
