"""``openrlhf-lopti <command>`` / ``python -m openrlhf_lopti <command>``.

Each command lives in its own module and is imported only when run, so ``--help`` stays fast. A user error
(a bad flag, file, row or folder) is one line on stderr and exit code 2; ``--debug`` shows its traceback
(:mod:`openrlhf_lopti.errors`).
"""

import importlib
import os
import sys
import warnings
from typing import Optional

from .errors import DEBUG_FLAG, UserError, run_command

# The folder holding the package: a source checkout's root, where benchmarks/ is (site-packages when installed).
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# command -> (module with a `main(argv) -> int`, one-line help)
COMMANDS = {
    "demo": ("openrlhf_lopti.demo.run", "tiny model, warm-up, then GRPO / +AR / +Lopti / +AR+Lopti side by side"),
    "train": ("openrlhf_lopti.local.cli", "one-process GRPO / REINFORCE++ trainer with AR and Lopti"),
    "audit": ("openrlhf_lopti.audit.cli", "token-probability diagnostics (paper Fig. 1d and Fig. 3)"),
    "study": ("openrlhf_lopti.audit.study", "seeds x methods on one setting, with 95% confidence intervals"),
    "eval": ("openrlhf_lopti.tasks.evaluate", "accuracy of generations per K&K size / math benchmark"),
    "data": ("openrlhf_lopti.tasks.data", "write OpenRLHF prompt datasets (K&K, math)"),
    "tiny-model": ("openrlhf_lopti.demo.tiny_model", "a random tiny Llama + K&K tokenizer (HF format) for dry runs"),
    "bench": ("openrlhf_lopti.cli.bench_loss_head", "benchmark the fused policy loss against OpenRLHF's path"),
    "bench-step": ("benchmarks.bench_train_step", "whole RL steps: GRPO / AR / Lopti, both trainers, every loss path"),
    "check-gpu": ("openrlhf_lopti.cli.check_gpu", "self-check the Triton kernel on this GPU + loss-head benchmark: a report"),
}


def usage() -> str:
    lines = ["usage: openrlhf-lopti <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`openrlhf-lopti <command> --help` shows a command's options; "
              f"`{DEBUG_FLAG}` shows the traceback of an error."]  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    words = [a for a in argv if a != DEBUG_FLAG]
    if not words or words[0] in ("-h", "--help"):
        print(usage())
        return 0
    prog = f"openrlhf-lopti {words[0]}" if words[0] in COMMANDS else "openrlhf-lopti"
    # torch's own import warns about the pynvml package on every run; it is not the user's to fix
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    return run_command(prog, _run, argv)


def _run(argv: list) -> int:
    name, rest = (argv[0], argv[1:]) if argv else ("", [])
    if name not in COMMANDS:
        raise UserError(f"unknown command {name!r}: use one of {', '.join(COMMANDS)} (see `openrlhf-lopti --help`)")
    module_name = COMMANDS[name][0]
    if module_name.startswith("benchmarks."):
        # benchmarks/ sits beside the package in a source checkout and is not installed with it. The script
        # itself must be there: site-packages may hold some other distribution's top-level `benchmarks`.
        script = os.path.join(SOURCE_ROOT, *module_name.split(".")) + ".py"
        if not os.path.isfile(script):
            raise UserError(
                f"`{name}` needs a source checkout ({module_name.replace('.', '/')}.py beside the package); "
                "this install has none"
            )
        sys.path.insert(0, SOURCE_ROOT)
    say_cpu_to_deepspeed()
    module = importlib.import_module(module_name)
    return int(module.main(rest) or 0)


def say_cpu_to_deepspeed() -> None:
    """On a machine where torch sees no CUDA device, set ``DS_ACCELERATOR=cpu`` (unless the user set it).

    transformers imports DeepSpeed when it saves or loads a model, and DeepSpeed, left to detect the accelerator,
    prints "Setting accelerator to CPU. If you have GPU ..." as a warning before our own first line.
    """
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


if __name__ == "__main__":
    sys.exit(main())
