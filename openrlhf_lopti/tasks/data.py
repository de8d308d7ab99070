r"""Dataset script: OpenRLHF prompt datasets (jsonl) for K&K puzzles and math problems.

K&K, generated here (no download) or converted from the public K&K files (jsonl / parquet):

    python -m openrlhf_lopti.tasks.data kk --out data/kk --people 3 4 5 6 7 --train-per-n 900 --test-per-n 100
    python -m openrlhf_lopti.tasks.data kk --out data/kk --source path/to/knights-and-knaves/   # public files

writes `train.jsonl` and `test.jsonl` (all sizes; train shuffled) and `train/people{N}.jsonl`,
`test/people{N}.jsonl`. Each line is

    {"prompt": [{"role": "system", ...}, {"role": "user", "content": <quiz>}],
     "label": "(1) Alice is a knight\n(2) ...", "num_people": N, "datasource": "kk_Nppl"}

Train with OpenRLHF 0.11.2 (`openrlhf.cli.train_ppo_ray`):

    --data.prompt_dataset data/kk/train.jsonl --data.input_key prompt --data.label_key label
    --data.apply_chat_template --eval.dataset data/kk/test.jsonl
    --reward.remote_url openrlhf_lopti/tasks/reward_kk.py

PromptDataset applies the tokenizer's chat template to the message list (`--data.apply_chat_template`),
passes `label` to the reward file, and `datasource` makes OpenRLHF's eval log one metric per size.
With `--plain-prompt` the prompt is a plain string instead (for models without a chat template; then
leave out `--data.apply_chat_template`).

Math, converted from a local jsonl / json / parquet with a problem and an answer per row:

    python -m openrlhf_lopti.tasks.data math --input math500.jsonl --benchmark math500 --out data/math/math500.jsonl

writes {"prompt": [...], "label": <answer>, "benchmark": name, "datasource": name}; rows without an
answer field but with a `solution` containing \boxed{} get the boxed content as label. Same training
flags with `--reward.remote_url openrlhf_lopti/tasks/reward_math.py`.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterable
from pathlib import Path

from openrlhf_lopti.tasks import kk
from openrlhf_lopti.tasks import math as math_task
from openrlhf_lopti.tasks import read_rows, write_jsonl

__all__ = ["build_parser", "kk_record", "kk_splits", "main", "math_records"]

_SEED_STRIDE = 1_000_003  # generator seeds of different --seed values never overlap below this many puzzles


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
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.suffix.lower() in (".jsonl", ".json", ".parquet"))
            files += [(f, f.relative_to(p).parts) for f in found]
        else:
            files.append((p, (p.parent.name, p.name)))
    if not files:
        raise FileNotFoundError(f"no .jsonl/.json/.parquet K&K files in {sources}")
    marked, pool = [], []
    for f, parts in files:
        is_test = any(d.lower() in ("test", "tests") for d in parts[:-1]) or parts[-1].lower().startswith("test")
        (marked if is_test else pool).extend(kk.load_public(f))
    return marked, pool


def kk_splits(
    people: list[int],
    train_per_n: int,
    test_per_n: int,
    seed: int = 0,
    sources: list[str] | None = None,
) -> dict[str, dict[int, list[dict]]]:
    """Puzzles per split ("train", "test") and number of people; no quiz appears in both splits.

    Without `sources`, puzzles are generated (test first, then train, from disjoint seeds). With public
    files, test-marked files feed the test split and the rest the train split; a size with no test file
    gets its test puzzles from the (seeded) shuffled pool. Counts are upper bounds for public data.
    """
    splits: dict[str, dict[int, list[dict]]] = {"train": {}, "test": {}}
    if sources:
        marked, pool = _public(sources)
        rng = random.Random(seed)
        for n in people:
            test = [r for r in marked if r["num_people"] == n]
            rest = [r for r in pool if r["num_people"] == n]
            rng.shuffle(rest)
            if not test:
                test, rest = rest[:test_per_n], rest[test_per_n:]
            test = test[:test_per_n]
            test_quizzes = {r["quiz"] for r in test}
            splits["test"][n] = test
            splits["train"][n] = [r for r in rest if r["quiz"] not in test_quizzes][:train_per_n]
        return splits
    for n in people:
        seen: set[str] = set()
        splits["test"][n], nxt = _generated(n, test_per_n, seed, 0, seen)
        splits["train"][n], _ = _generated(n, train_per_n, seed, nxt, seen)
    return splits


def math_records(
    rows: Iterable[dict], benchmark: str, problem_key: str = "problem", answer_key: str = "answer"
) -> list[dict]:
    r"""OpenRLHF prompt records for math rows; the label is the answer (or the \boxed{} of `solution`)."""
    out = []
    for i, row in enumerate(rows):
        answer = row.get(answer_key)
        if answer is None and isinstance(row.get("solution"), str):
            answer = math_task.last_boxed(row["solution"])
        if problem_key not in row or answer is None:
            raise ValueError(f"row {i}: needs '{problem_key}' and '{answer_key}' (or a solution with \\boxed{{}})")
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
    parser = argparse.ArgumentParser(prog="openrlhf-lopti data", description="Write OpenRLHF prompt datasets.")
    sub = parser.add_subparsers(dest="task", required=True)

    p = sub.add_parser("kk", help="Knights and Knaves puzzles (generated, or from the public files)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--people", type=int, nargs="+", default=[3, 4, 5, 6, 7], help="numbers of people")
    p.add_argument("--train-per-n", type=int, default=900, help="train puzzles per number of people")
    p.add_argument("--test-per-n", type=int, default=100, help="test puzzles per number of people")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", nargs="+", default=None, help="public K&K files or directories (jsonl/parquet)")
    p.add_argument("--plain-prompt", action="store_true", help="prompt as plain text instead of chat messages")

    p = sub.add_parser("math", help="math problems from a local jsonl/json/parquet")
    p.add_argument("--input", nargs="+", required=True, help="input files")
    p.add_argument("--out", required=True, help="output jsonl")
    p.add_argument("--benchmark", required=True, help="benchmark name stored in each record (e.g. math500)")
    p.add_argument("--problem-key", default="problem")
    p.add_argument("--answer-key", default="answer")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `openrlhf-lopti data` / `python -m openrlhf_lopti.tasks.data`."""
    args = build_parser().parse_args(argv)
    if args.task == "math":
        rows = [r for path in args.input for r in read_rows(path)]
        n = write_jsonl(args.out, math_records(rows, args.benchmark, args.problem_key, args.answer_key))
        print(f"wrote {n} {args.benchmark} prompts to {args.out}")
        return 0

    out = Path(args.out)
    splits = kk_splits(args.people, args.train_per_n, args.test_per_n, args.seed, args.source)
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
    sys.exit(main())
