"""``python -m openrlhf_lopti.verl.data DIR``: our K&K prompt files as verl's parquet datasets.

``python -m openrlhf_lopti data kk --out DIR`` writes OpenRLHF prompt files (``DIR/train.jsonl``, ``DIR/test.jsonl``,
one line per puzzle: ``prompt`` as chat messages, ``label``, ``num_people``, ``datasource``). verl's ``RLHFDataset``
reads parquet files with one row per prompt and these columns (``data.prompt_key=prompt``,
``data.reward_fn_key=data_source``):

==================  =====================================================================================
``data_source``     ``kk_<N>ppl`` (verl's validation logs accuracy per data source: one line per size)
``prompt``          the chat messages, as written (verl applies the tokenizer's chat template)
``ability``         ``logic``
``reward_model``    ``{"style": "rule", "ground_truth": <label>}``: the label reaches the reward function
``extra_info``      ``{"split", "index", "num_people"}``
==================  =====================================================================================

This writes ``DIR/train.parquet`` and ``DIR/test.parquet`` (``--out`` elsewhere); existing parquet files are
replaced only with ``--overwrite``. An empty split or a malformed row is refused in one line naming the file and
line, before anything is written. The reward is :mod:`openrlhf_lopti.verl.reward` (``compute_score``), the
paper's rule from ``openrlhf_lopti.tasks.kk``.
"""

import sys
from pathlib import Path
from typing import List, Optional

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.tasks import kk, load_rows

SPLITS = ("train", "test")


def verl_row(record: dict, split: str, index: int, where: str) -> dict:
    """One verl dataset row from one line of ``openrlhf-lopti data kk``."""
    missing = [key for key in ("prompt", "label", "num_people", "datasource") if key not in record]
    if missing:
        raise UserError(f"{where}: no {', '.join(missing)}: write the files with `python -m openrlhf_lopti data kk`")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        raise UserError(f"{where}: the prompt is plain text; verl applies the chat template to chat messages: "
                        "write the files without --plain-prompt")  # fmt: skip
    messages_form = 'a list of {"role": ..., "content": ...} messages with text values'
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        raise UserError(f"{where}: prompt must be {messages_form}, got {_shown(prompt)}")
    number = _whole_number(record["num_people"])
    if number is None or number < 1:
        raise UserError(f"{where}: num_people must be a whole number >= 1, got {_shown(record['num_people'])}")
    if not isinstance(record["label"], str) or not isinstance(record["datasource"], str):
        bad = "label" if not isinstance(record["label"], str) else "datasource"
        raise UserError(f"{where}: {bad} must be text, got {_shown(record[bad])}")
    try:  # the reward reads it in a Ray worker, after the rollout: a label it cannot read is refused here
        kk.parse_solution_text(record["label"])
    except ValueError as exc:
        raise UserError(f"{where}: label: {exc} (a K&K label: one '(k) Name is a knight|knave' per line)") from None
    return {
        "data_source": record["datasource"],
        "prompt": [{"role": m["role"], "content": m["content"]} for m in prompt],
        "ability": "logic",
        "reward_model": {"style": "rule", "ground_truth": record["label"]},
        "extra_info": {"split": split, "index": index, "num_people": number},
    }


def _whole_number(value) -> Optional[int]:
    """``value`` as an int when it is one (3, 3.0, "3"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def convert(src: Path, out: Path, overwrite: bool = False) -> List[Path]:
    """``src/{train,test}.jsonl`` -> ``out/{train,test}.parquet``; returns the files written."""
    import pandas as pd

    inputs = [src / f"{split}.jsonl" for split in SPLITS]
    absent = [str(path) for path in inputs if not path.is_file()]
    if absent:
        raise UserError(f"{', '.join(absent)} not found: write them with `python -m openrlhf_lopti data kk --out {src}`")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file; --out takes a folder (train.parquet and test.parquet go there)")
    outputs = [out / f"{split}.parquet" for split in SPLITS]
    existing = [str(path) for path in outputs if path.exists()]
    if existing and not overwrite:
        raise UserError(f"{', '.join(existing)} already exist(s): pass --overwrite to replace them")
    rows = {}
    for split, path in zip(SPLITS, inputs):
        records, where = load_rows(path)
        if not records:  # verl's dataset cannot read a parquet file of no rows (it has no columns either)
            raise UserError(f"{path} has no prompts: verl cannot load an empty dataset; write at least one (data kk "
                            f"--{split}-per-n 1)")  # fmt: skip
        rows[split] = [verl_row(r, split, i, where[i]) for i, r in enumerate(records)]
    try:
        out.mkdir(parents=True, exist_ok=True)
        for split, path in zip(SPLITS, outputs):
            pd.DataFrame(rows[split]).to_parquet(path, index=False)
            print(f"{split}: {len(rows[split])} prompts -> {path}")
    except OSError as e:  # a folder on the way that is a file, no permission, a full disk
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return outputs


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m openrlhf_lopti.verl.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="the folder `python -m openrlhf_lopti data kk --out` wrote")
    parser.add_argument("--out", default=None, help="where to write train.parquet / test.parquet (default: src)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing train.parquet / test.parquet")
    return parser


def main(argv: Optional[list] = None) -> int:
    def run(args: list) -> int:
        ns = build_parser().parse_args(args)
        convert(Path(ns.src), Path(ns.out or ns.src), ns.overwrite)
        return 0

    return run_command("openrlhf_lopti.verl.data", run, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
