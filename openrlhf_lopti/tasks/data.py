r"""Dataset script: OpenRLHF prompt datasets (jsonl) for K&K puzzles and math problems.

K&K, generated here (no download) or converted from the public K&K files (jsonl / parquet):

    python -m openrlhf_lopti.tasks.data kk --out data/kk --people 3 4 5 6 7 --train-per-n 900 --test-per-n 100
    python -m openrlhf_lopti.tasks.data kk --out data/kk --source path/to/knights-and-knaves/   # public files

writes `train.jsonl` and `test.jsonl` (all sizes; train shuffled) and `train/people{N}.jsonl`,
`test/people{N}.jsonl`. From public files it takes every size and every puzzle they hold unless
`--people` / `--train-per-n` / `--test-per-n` say otherwise. An `--out` that already holds these files
is refused unless `--overwrite`, which removes exactly them (stale `people{N}.jsonl` of sizes not
written again included) and nothing else. Each line is

    {"prompt": [{"role": "system", ...}, {"role": "user", "content": <quiz>}],
     "label": "(1) Alice is a knight\n(2) ...", "num_people": N, "datasource": "kk_Nppl"}

Train with OpenRLHF 0.11.2 (`openrlhf.cli.train_ppo_ray`):

    --data.prompt_dataset data/kk/train.jsonl --data.input_key prompt --data.label_key label
    --data.apply_chat_template --eval.dataset data/kk/test.jsonl
    --reward.remote_url "$(python -c 'import openrlhf_lopti.tasks.reward_kk as m; print(m.__file__)')"

PromptDataset applies the tokenizer's chat template to the message list (`--data.apply_chat_template`),
passes `label` to the reward file, and `datasource` makes OpenRLHF's eval log one metric per size.
With `--plain-prompt` the prompt is a plain string instead (for models without a chat template; then
leave out `--data.apply_chat_template`).

Math, converted from a local jsonl / json / parquet with a problem and an answer per row:

    python -m openrlhf_lopti.tasks.data math --input math500.jsonl --benchmark math500 --out data/math/math500.jsonl

writes {"prompt": [...], "label": <answer>, "benchmark": name, "datasource": name}; rows without an
answer field but with a `solution` containing \boxed{} get the boxed content as label. Same training
flags with the installed `openrlhf_lopti/tasks/reward_math.py` as `--reward.remote_url`. The output file is
never one of the inputs, and an existing one is replaced only with `--overwrite`.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterable
from pathlib import Path

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.runs import check_out_dir, prepare_out_dir, prepare_out_file
from openrlhf_lopti.tasks import kk
from openrlhf_lopti.tasks import math as math_task
from openrlhf_lopti.tasks import load_rows, write_jsonl

__all__ = ["build_parser", "kk_record", "kk_splits", "main", "math_records"]

_SEED_STRIDE = 1_000_003  # generator seeds of different --seed values never overlap below this many puzzles
GENERATED_DEFAULTS = {"people": [3, 4, 5, 6, 7], "train_per_n": 900, "test_per_n": 100}
POOL_TEST_PER_N = 100  # test puzzles per size taken from the pool when the public files have no test file
# What `data kk` writes into --out: exactly these names are refused / removed by --overwrite.
KK_OUTPUTS = ("train.jsonl", "test.jsonl") + tuple(
    f"{split}/people{n}.jsonl" for split in ("train", "test") for n in ("[0-9]", "[0-9][0-9]")
)


def kk_record(puzzle: dict, *, plain_prompt: bool = False) -> dict:
    """OpenRLHF prompt record of one puzzle: prompt, label (solution_text_format), num_people, datasource."""
    n = len(puzzle["names"])
    return {
        "prompt": kk.prompt_text(puzzle) if plain_prompt else kk.make_prompt(puzzle),
        "label": puzzle["solution_text_format"],
        "num_people": n,
        "datasource": f"kk_{n}ppl",
    }


def _generated(n: int, count: int, seed: int, start: int, seen: set[str]) -> tuple[list[dict], int]:
    """`count` new puzzles of n people from seeds seed*stride + start, ..., skipping quizzes in `seen`."""
    out, i = [], start
    while len(out) < count:
        if i - start > 20 * count + 1000:
            raise RuntimeError(f"could not find {count} distinct {n}-people puzzles")
        p = kk.generate(n, seed * _SEED_STRIDE + i)
        i += 1
        if p["quiz"] not in seen:
            seen.add(p["quiz"])
            out.append(p)
    return out, i


def _public(sources: list[str]) -> tuple[list[dict], list[dict]]:
    """Records of the public files under `sources`, as (test-marked, unmarked) lists.

    A file counts as test data when its name starts with "test" or it sits in a folder named "test"
    below the given source directory (for a file source: its parent folder), as in the public layout
    `train/people3_num1000.jsonl`, `test/people3_num100.jsonl`.
    """
    files: list[tuple[Path, tuple[str, ...]]] = []  # (file, path parts that may mark it as test)
    for s in sources:
        p = Path(s)
        if not p.exists():
            raise UserError(f"--source {s}: no such file or folder")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.suffix.lower() in (".jsonl", ".json", ".parquet"))
            files += [(f, f.relative_to(p).parts) for f in found]
        else:
            files.append((p, (p.parent.name, p.name)))
    if not files:
        raise UserError(f"--source {' '.join(sources)}: no .jsonl / .json / .parquet K&K files there")
    marked, pool = [], []
    for f, parts in files:
        is_test = any(d.lower() in ("test", "tests") for d in parts[:-1]) or parts[-1].lower().startswith("test")
        (marked if is_test else pool).extend(kk.load_public(f))
    return marked, pool


def kk_splits(
    people: list[int] | None,
    train_per_n: int | None,
    test_per_n: int | None,
    seed: int = 0,
    sources: list[str] | None = None,
) -> dict[str, dict[int, list[dict]]]:
    """Puzzles per split ("train", "test") and number of people; no quiz appears in both splits.

    Without `sources`, puzzles are generated (test first, then train, from disjoint seeds); a None
    argument takes :data:`GENERATED_DEFAULTS`. With public files, test-marked files feed the test split
    and the rest the train split; a size with no test file gets its test puzzles from the (seeded)
    shuffled pool (``test_per_n``, default :data:`POOL_TEST_PER_N`). There, None means every size and
    every puzzle the files hold, and counts are upper bounds; a size the files lack is an error.
    """
    splits: dict[str, dict[int, list[dict]]] = {"train": {}, "test": {}}
    if sources:
        marked, pool = _public(sources)
        found = sorted({r["num_people"] for r in marked + pool})
        for n in people or found:
            if n not in found:
                raise UserError(
                    f"--people {n}: the --source files have no {n}-person puzzles (they have sizes "
                    f"{', '.join(map(str, found))})"
                )
        rng = random.Random(seed)
        for n in people or found:
            test = [r for r in marked if r["num_people"] == n]
            rest = [r for r in pool if r["num_people"] == n]
            rng.shuffle(rest)
            if not test:
                k = POOL_TEST_PER_N if test_per_n is None else test_per_n
                test, rest = rest[:k], rest[k:]
            test = test[:test_per_n]
            test_quizzes = {r["quiz"] for r in test}
            splits["test"][n] = test
            splits["train"][n] = [r for r in rest if r["quiz"] not in test_quizzes][:train_per_n]
        return splits
    people = GENERATED_DEFAULTS["people"] if people is None else people
    train_per_n = GENERATED_DEFAULTS["train_per_n"] if train_per_n is None else train_per_n
    test_per_n = GENERATED_DEFAULTS["test_per_n"] if test_per_n is None else test_per_n
    for n in people:
        seen: set[str] = set()
        splits["test"][n], nxt = _generated(n, test_per_n, seed, 0, seen)
        splits["train"][n], _ = _generated(n, train_per_n, seed, nxt, seen)
    return splits


def math_records(
    rows: Iterable[dict],
    benchmark: str,
    problem_key: str = "problem",
    answer_key: str = "answer",
    where: list[str] | None = None,
) -> list[dict]:
    r"""OpenRLHF prompt records for math rows; the label is the answer (or the \boxed{} of `solution`).

    ``where[i]`` says where row i came from (``"file.jsonl line 3"``) for error messages.
    """
    out = []
    for i, row in enumerate(rows):
        at = where[i] if where is not None else f"row {i + 1}"
        keys = ", ".join(sorted(map(str, row))[:8]) or "no keys"
        if problem_key not in row:
            raise UserError(f"{at}: no {problem_key!r} key (the row has {keys}); pass --problem-key with the "
                            "name of the problem field")  # fmt: skip
        answer, named = row.get(answer_key), repr(answer_key)
        if answer is None and isinstance(row.get("solution"), str):
            answer, named = math_task.last_boxed(row["solution"]), "the \\boxed{} of 'solution'"
        if answer is None:
            raise UserError(f"{at}: no {answer_key!r} key and no 'solution' with a \\boxed{{}} answer (the row "
                            f"has {keys}); pass --answer-key with the name of the answer field")  # fmt: skip
        if isinstance(answer, list) and len(answer) == 1:  # OlympiadBench's final_answer: a list of one answer
            answer = answer[0]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise UserError(f"{at}: {named} must be a string or a number (the answer), got "
                            f"{type(answer).__name__} {str(answer)[:60]!r}")  # fmt: skip
        if not str(answer).strip():
            raise UserError(f"{at}: {named} is empty; every problem needs its answer")
        out.append(
            {
                "prompt": math_task.make_prompt(str(row[problem_key])),
                "label": str(answer),
                "benchmark": benchmark,
                "datasource": benchmark,
            }
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    """Argument parser with the `kk` and `math` sub-commands."""
    parser = ArgumentParser(prog="openrlhf-lopti data", description="Write OpenRLHF prompt datasets.")
    sub = parser.add_subparsers(dest="task", required=True)

    p = sub.add_parser("kk", help="Knights and Knaves puzzles (generated, or from the public files)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--people", type=int, nargs="+", default=None,
                   help="numbers of people (default 3 4 5 6 7; with --source: every size the files hold)")  # fmt: skip
    p.add_argument("--train-per-n", type=int, default=None,
                   help="train puzzles per number of people (default 900; with --source: all)")  # fmt: skip
    p.add_argument("--test-per-n", type=int, default=None,
                   help=f"test puzzles per number of people (default 100; with --source: all of the test "
                   f"files, or {POOL_TEST_PER_N} from the pool for a size without one)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", nargs="+", default=None, help="public K&K files or directories (jsonl/parquet)")
    p.add_argument("--plain-prompt", action="store_true", help="prompt as plain text instead of chat messages")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the files an earlier run wrote into --out (train.jsonl, test.jsonl, "
                   "train/people<N>.jsonl, test/people<N>.jsonl) and only those")  # fmt: skip

    p = sub.add_parser("math", help="math problems from a local jsonl/json/parquet")
    p.add_argument("--input", nargs="+", required=True, help="input files (jsonl, json, parquet, datasets folder)")
    p.add_argument("--out", required=True, help="output jsonl (never one of the inputs)")
    p.add_argument("--benchmark", required=True, help="benchmark name stored in each record (e.g. math500)")
    p.add_argument("--problem-key", default="problem", help="field of the problem text (default problem)")
    p.add_argument("--answer-key", default="answer",
                   help="field of the final answer (default answer; else a \\boxed{} in `solution`)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return parser


def _check_counts(args: argparse.Namespace) -> None:
    for flag in ("train_per_n", "test_per_n"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 0, got {value}")
    if args.train_per_n == 0 and args.test_per_n == 0:  # two empty files that verl.data and train refuse later
        raise UserError("--train-per-n 0 --test-per-n 0: nothing to write; give at least one of them > 0")
    most = min(kk.MAX_PEOPLE, len(kk.NAMES))
    for n in args.people or []:
        if not 2 <= n <= most:
            raise UserError(f"--people {n}: K&K puzzles have 2 to {most} people")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `openrlhf-lopti data` / `python -m openrlhf_lopti.tasks.data`."""
    args = build_parser().parse_args(argv)
    if args.task == "math":
        if not args.benchmark.strip():  # every record's group name in `eval`
            raise UserError(f"--benchmark {args.benchmark!r}: expected a benchmark name, e.g. math500")
        inputs = [("--input", path) for path in args.input]
        out = prepare_out_file(args.out, overwrite=args.overwrite, inputs=inputs)
        rows, where = [], []
        for path in args.input:
            more, at = load_rows(path, "--input")
            rows += more
            where += at
        if not rows:
            raise UserError(f"--input {' '.join(args.input)}: no rows")
        records = math_records(rows, args.benchmark, args.problem_key, args.answer_key, where)
        n = write_jsonl(out, records)
        print(f"wrote {n} {args.benchmark} prompts to {out}")
        return 0

    _check_counts(args)
    inputs = [("--source", s) for s in args.source or []]
    check_out_dir(args.out, KK_OUTPUTS, overwrite=args.overwrite, inputs=inputs)  # refuse before the work
    splits = kk_splits(args.people, args.train_per_n, args.test_per_n, args.seed, args.source)
    out = prepare_out_dir(args.out, KK_OUTPUTS, overwrite=args.overwrite, inputs=inputs)
    for split, by_n in splits.items():
        rows = []
        for n, puzzles in by_n.items():
            recs = [kk_record(p, plain_prompt=args.plain_prompt) for p in puzzles]
            write_jsonl(out / split / f"people{n}.jsonl", recs)
            rows += recs
        if split == "train":  # mixed sizes for readers that do not shuffle
            random.Random(args.seed).shuffle(rows)
        write_jsonl(out / f"{split}.jsonl", rows)
        sizes = ", ".join(f"{n}: {len(p)}" for n, p in by_n.items())
        print(f"{split}: {len(rows)} prompts ({sizes}) -> {out / split}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("openrlhf-lopti data", main, sys.argv[1:]))
