r"""Evaluation: K&K accuracy per number of people, math accuracy per benchmark (greedy or avg@k).

From a jsonl of generations:

    python -m openrlhf_lopti.tasks.evaluate --task kk --generations gens.jsonl [--out runs/eval-kk]

or by generating with a local model (transformers `generate`; needs transformers installed) on a
prompt file written by `openrlhf-lopti data`:

    python -m openrlhf_lopti.tasks.evaluate --task kk --model path/to/model --data data/kk/test.jsonl \
        --n-samples 1 --max-new-tokens 4096 --out runs/eval-kk

Writes into the folder `--out` (default `runs/eval-<timestamp>`): `results.json` (the metrics, and which
model, data and settings produced them) and, with `--model`, `generations.jsonl` (the generations file
below, which `--generations` reads back). An `--out` holding these files is refused unless `--overwrite`.

Generations file: one JSON object per line with `label` (K&K: solution_text_format; math: the answer),
`responses` (list of strings) or `response` (one string), and the group key: `num_people` for K&K
(taken from the label's line count when absent), `benchmark` (or `datasource`) for math. Lines with the
same `id` (else the same `prompt`) are merged, so one line per sample works too.

`--limit N` keeps the first N prompts of each group (each number of people, each benchmark), so a quick
run still covers every group.

Metrics, per group:
- accuracy: the mean over prompts of the fraction of a prompt's samples that are right; with one
  greedy sample per prompt that is greedy accuracy, with k sampled ones avg@k (paper: MATH-500,
  Minerva, OlympiadBench greedy; AMC, AIME avg@16);
- pass@k: fraction of prompts with at least one right sample;
- K&K: right = the paper's answer score is +2 (valid format and every role right), the paper's test
  accuracy; also the format rate and the mean reward. Math: right = reward 1; also the \boxed rate.
The table's last row averages accuracy over groups (the paper's "average over 3..7 people").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command
from openrlhf_lopti.runs import check_model_dir, prepare_out_dir
from openrlhf_lopti.tasks import kk
from openrlhf_lopti.tasks import math as math_task
from openrlhf_lopti.tasks import load_rows, messages_to_text, write_jsonl

__all__ = ["build_parser", "evaluate", "format_table", "generate_local", "main"]


RESULTS_FILE = "results.json"
GENERATIONS_FILE = "generations.jsonl"
SEED_LIMIT = 2**63  # torch.manual_seed's range (a signed 64-bit seed either way)


def _merge(records: Iterable[dict], where: list[str] | None = None) -> list[tuple[dict, str]]:
    """One entry per prompt with all its responses (records sharing `id`, else `prompt`, are merged), each
    with where its first record came from (``where[i]``, else ``"record <i+1>"``)."""
    merged: dict[str, tuple[dict, str]] = {}
    for i, rec in enumerate(records):
        at = where[i] if where is not None else f"record {i + 1}"
        if "responses" in rec:
            responses = rec["responses"]
            if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
                raise UserError(f"{at}: 'responses' must be a list of strings, got {type(responses).__name__}")
        elif "response" in rec:
            if not isinstance(rec["response"], str):
                raise UserError(f"{at}: 'response' must be a string, got {type(rec['response']).__name__}")
            responses = [rec["response"]]
        else:
            raise UserError(f"{at}: no 'responses' (a list of strings) or 'response' (a string) key; --generations "
                            "takes a file like the generations.jsonl that `eval --model` writes")  # fmt: skip
        if "label" not in rec:
            raise UserError(f"{at}: no 'label' key (the K&K solution_text_format or the math answer)")
        if "id" in rec:
            key = f"id:{rec['id']}"
        elif "prompt" in rec:
            key = "prompt:" + json.dumps(rec["prompt"], sort_keys=True)
        else:
            key = f"line:{i}"
        entry, _ = merged.setdefault(key, ({**rec, "responses": []}, at))
        entry["responses"].extend(responses)
    return list(merged.values())


def first_per_group(records: list, task: str, limit: int | None, where: list[str] | None = None) -> list[int]:
    """Indices of the records of the first ``limit`` prompts of each group (all when ``limit`` is None).

    Records of one prompt (same ``id``, else same ``prompt``) count once, so one line per sample works.
    """
    if limit is None:
        return list(range(len(records)))
    group_of = _kk_group if task == "kk" else _math_group
    kept: dict[str, set] = {}
    out = []
    for i, rec in enumerate(records):
        at = where[i] if where is not None else f"record {i + 1}"
        prompt = rec.get("id", json.dumps(rec.get("prompt", i), sort_keys=True))
        _check_label(rec, task, at)
        group = _checked_group(group_of, rec, at)
        prompts = kept.setdefault(group, set())
        if prompt in prompts or len(prompts) < limit:
            prompts.add(prompt)
            out.append(i)
    return out


def _check_label(rec: dict, task: str, at: str, key: str = "label") -> None:
    """Raise :class:`UserError` at ``at`` unless ``rec[key]`` (when there) has the task's type: a string for K&K
    (the solution_text_format), a string or a number for math (the answer)."""
    if key not in rec:
        return  # _merge / _prompt_rows name the missing key
    label = rec[key]
    if task == "kk" and not isinstance(label, str):
        raise UserError(f"{at}: {key!r} must be a string (the K&K solution_text_format, e.g. \"(1) Alice is a "
                        f"knight\"), got {type(label).__name__} {str(label)[:60]!r}")  # fmt: skip
    if task == "math" and (isinstance(label, bool) or not isinstance(label, (str, int, float))):
        raise UserError(f"{at}: {key!r} must be a string or a number (the math answer), got {type(label).__name__} "
                        f"{str(label)[:60]!r}")  # fmt: skip
    if task == "math" and not str(label).strip():
        raise UserError(f"{at}: {key!r} is empty; a math label is the answer")


def _checked_group(group_of, rec: dict, at: str) -> str:
    try:
        return group_of(rec)
    except (KeyError, ValueError, TypeError) as e:  # a K&K label that does not parse
        raise UserError(f"{at}: cannot tell the K&K size from 'label' {str(rec.get('label'))[:60]!r} ({e}); "
                        "add num_people or fix the label")  # fmt: skip


def _kk_group(rec: dict) -> str:
    if rec.get("num_people") is not None:
        return str(rec["num_people"])
    return str(len(kk.parse_solution_text(rec["label"])[0]))


def _math_group(rec: dict) -> str:
    return str(rec.get("benchmark") or rec.get("datasource") or "math")


def _score_kk(response: str, label: str) -> dict[str, float]:
    fmt, ans = kk.reward_parts(response, label)
    return {"right": float(ans == 2.0), "format": float(fmt == 1.0), "reward": fmt + ans}


def _score_math(response: str, label: str) -> dict[str, float]:
    pred = math_task.last_boxed(response)
    return {"right": float(math_task.is_equiv(pred, str(label))), "boxed": float(pred is not None)}


def evaluate(records: Iterable[dict], task: str, where: list[str] | None = None) -> dict:
    """Metrics per group (K&K: number of people; math: benchmark) and their average; see module doc.

    ``where[i]`` says where record i came from (``"gens.jsonl line 3"``), for error messages.
    """
    if task not in ("kk", "math"):
        raise ValueError(f"task must be 'kk' or 'math', got {task!r}")
    score, group_of = (_score_kk, _kk_group) if task == "kk" else (_score_math, _math_group)
    groups: dict[str, list[list[dict[str, float]]]] = {}
    for rec, at in _merge(records, where):
        if not rec["responses"]:  # a prompt never sampled is neither right nor wrong: refused, not dropped
            raise UserError(f"{at}: 'responses' is empty; each prompt needs at least one response to score")
        _check_label(rec, task, at)
        group = _checked_group(group_of, rec, at)
        try:
            scored = [score(r, rec["label"]) for r in rec["responses"]]
        except (ValueError, TypeError) as e:  # kk.reward_parts refuses a label that is not a solution_text_format
            raise UserError(f"{at}: 'label' is not a K&K solution ({e}); is --task right?") from None
        groups.setdefault(group, []).append(scored)

    def sort_key(name: str) -> tuple:
        return (0, int(name), "") if name.isdigit() else (1, 0, name)

    out: dict[str, dict] = {}
    for name in sorted(groups, key=sort_key):
        prompts = groups[name]
        samples = [s for p in prompts for s in p]
        ks = {len(p) for p in prompts}
        k = max(ks)
        row = {
            "prompts": len(prompts),
            "samples": len(samples),
            "metric": "greedy" if ks == {1} else f"avg@{k}" if len(ks) == 1 else "avg@ragged",
            "accuracy": sum(sum(s["right"] for s in p) / len(p) for p in prompts) / len(prompts),
            f"pass@{k}": sum(any(s["right"] for s in p) for p in prompts) / len(prompts),
        }
        for extra in samples[0]:
            if extra != "right":
                key = "mean_reward" if extra == "reward" else f"{extra}_rate"
                row[key] = sum(s[extra] for s in samples) / len(samples)
        out[name] = row
    average = sum(r["accuracy"] for r in out.values()) / len(out) if out else 0.0
    return {"task": task, "group_by": "num_people" if task == "kk" else "benchmark", "groups": out, "average": average}


def format_table(results: dict) -> str:
    """Plain-text table of `evaluate` results, one row per group and an average row."""
    groups = results["groups"]
    extra = sorted({k for r in groups.values() for k in r} - {"prompts", "samples", "metric", "accuracy"})
    head = [results["group_by"], "prompts", "metric", "accuracy", *extra]
    rows = []
    for name, r in groups.items():
        cells = [f"{r[e]:.4f}" if e in r else "" for e in extra]
        rows.append([name, str(r["prompts"]), r["metric"], f"{r['accuracy']:.4f}", *cells])
    rows.append(["average", "", "", f"{results['average']:.4f}", *([""] * len(extra))])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *rows])


def generate_local(
    model_path: str,
    prompts: list,
    *,
    n_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 1024,
    batch_size: int = 8,
    seed: int = 0,
) -> list[list[str]]:
    """Responses of a local Hugging Face causal LM: `n_samples` per prompt (chat messages or text).

    Message lists go through the tokenizer's chat template (plain-text rendering when it has none),
    matching OpenRLHF's `--data.apply_chat_template`. temperature 0 means greedy decoding, which has one answer
    per prompt: it needs ``n_samples == 1``.
    """
    if temperature == 0 and n_samples > 1:
        raise ValueError(f"temperature 0 is greedy decoding (one answer per prompt): n_samples must be 1, "
                         f"got {n_samples}")  # fmt: skip
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-file "Loading weights" bars in the command's output
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"  # decoder-only batches must be left-padded
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto").to(device).eval()

    def render(p) -> str:
        if isinstance(p, str):
            return p
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        return messages_to_text(p)

    texts = [render(p) for p in prompts]
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p}
    out: list[list[str]] = []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        # Chat-templated text already holds its special tokens (OpenRLHF tokenizes it the same way).
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            gen = model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                max_new_tokens=max_new_tokens,
                num_return_sequences=n_samples,
                pad_token_id=tok.pad_token_id,
                **sampling,
            )
        new = gen[:, enc["input_ids"].shape[1] :]
        decoded = tok.batch_decode(new, skip_special_tokens=True)
        out += [decoded[i * n_samples : (i + 1) * n_samples] for i in range(len(batch))]
    return out


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of `openrlhf-lopti eval`."""
    p = ArgumentParser(prog="openrlhf-lopti eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("kk", "math"), required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--generations", help="jsonl of generations (see `Generations file` in the README)")
    src.add_argument("--model", help="local Hugging Face model folder to generate with (needs --data)")
    p.add_argument("--data", help="prompt file (jsonl, json, parquet, datasets folder), e.g. from `data kk`")
    p.add_argument("--input-key", default="prompt", help="--data field of the prompt (default prompt)")
    p.add_argument("--label-key", default="label", help="field of the label (default label)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="also wrap string prompts as a user message through the chat template (message "
                   "lists always go through it), as train / OpenRLHF's --data.apply_chat_template")  # fmt: skip
    p.add_argument("--n-samples", type=int, default=1, help="samples per prompt (avg@k); 1 = greedy")
    p.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy) for 1 sample, else 1.0")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts of each group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's choice)")
    p.add_argument("--out", default=None, help=f"output folder: {RESULTS_FILE}, and {GENERATIONS_FILE} with "
                   "--model (default runs/eval-<timestamp>)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help=f"replace {RESULTS_FILE} / {GENERATIONS_FILE} in --out")
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.model and not args.data:
        raise UserError("--model needs --data (the prompt file to generate from)")
    if args.generations and args.data:
        raise UserError("--data goes with --model; --generations already holds the prompts' labels")
    for flag in ("n_samples", "max_new_tokens", "batch_size", "limit"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.temperature is not None and not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise UserError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.model and args.temperature == 0 and args.n_samples > 1:
        raise UserError(f"--temperature 0 is greedy decoding, one answer per prompt: with --n-samples "
                        f"{args.n_samples} pass a --temperature > 0 (the default for --n-samples > 1 is 1.0), or "
                        "--n-samples 1")  # fmt: skip
    if args.threads < 0:
        raise UserError(f"--threads must be >= 0 (0: torch's choice), got {args.threads}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not abs(args.seed) < SEED_LIMIT:  # torch's generator takes 64 bits; checked before --out is made
        raise UserError(f"--seed must be an integer with |seed| < 2**63, got {args.seed}")


def _prompt_rows(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """The --data rows (those --limit keeps), each checked for the prompt and label keys."""
    rows, where = load_rows(args.data, "--data")
    if not rows:
        raise UserError(f"--data {args.data}: no rows")
    for row, at in zip(rows, where):
        for flag, key in (("--input-key", args.input_key), ("--label-key", args.label_key)):
            if key not in row:
                keys = ", ".join(sorted(map(str, row))[:8])
                raise UserError(f"{at}: no {key!r} key (the row has {keys}); pass {flag} with the right field name")
        prompt = row[args.input_key]
        messages = isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )  # as train's --data (local.dataset): a chat is a non-empty list of {'role', 'content'} strings
        if not (isinstance(prompt, str) or messages):
            raise UserError(f"{at}: {args.input_key!r} must be a string or a list of {{'role', 'content'}} chat "
                            f"messages, got {json.dumps(prompt)[:60]}")  # fmt: skip
        _check_label(row, args.task, at, args.label_key)
    rows = [{**row, "label": row[args.label_key]} for row in rows]
    keep = first_per_group(rows, args.task, args.limit, where)
    return [rows[i] for i in keep], [where[i] for i in keep]


def main(argv: list[str] | None = None) -> int:
    """Entry point of `openrlhf-lopti eval` / `python -m openrlhf_lopti.tasks.evaluate`."""
    args = build_parser().parse_args(argv)
    _check_args(args)
    inputs = [("--generations", args.generations), ("--data", args.data), ("--model", args.model)]
    out = Path(args.out or time.strftime("runs/eval-%Y%m%d-%H%M%S"))
    names = [RESULTS_FILE] + ([GENERATIONS_FILE] if args.model else [])
    if args.model:
        check_model_dir(args.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model:
        rows, where = _prompt_rows(args)
        out = prepare_out_dir(out, names, overwrite=args.overwrite, inputs=inputs)
        prompts = [row[args.input_key] for row in rows]
        if args.apply_chat_template:
            prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        temperature = args.temperature if args.temperature is not None else (0.0 if args.n_samples == 1 else 1.0)
        responses = generate_local(
            args.model,
            prompts,
            n_samples=args.n_samples,
            temperature=temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            seed=args.seed,
        )
        records = [{**r, "responses": rs} for r, rs in zip(rows, responses)]
        write_jsonl(out / GENERATIONS_FILE, records)
        source = {"model": args.model, "data": args.data, "n_samples": args.n_samples, "temperature": temperature,
                  "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "seed": args.seed}  # fmt: skip
    else:
        rows, where = load_rows(args.generations, "--generations")
        if not rows:
            raise UserError(f"--generations {args.generations}: no rows")
        if args.label_key != "label":
            for row, at in zip(rows, where):
                if args.label_key not in row:  # not the file's 'label' instead: the user named another field
                    keys = ", ".join(sorted(map(str, row))[:8])
                    raise UserError(f"{at}: no {args.label_key!r} key (the row has {keys}); pass --label-key with "
                                    "the right field name")  # fmt: skip
            rows = [{**r, "label": r[args.label_key]} for r in rows]
        keep = first_per_group(rows, args.task, args.limit, where)
        records, where = [rows[i] for i in keep], [where[i] for i in keep]
        source = {"generations": args.generations}

    results = evaluate(records, args.task, where)
    if not args.model:  # (with --model the folder was prepared before generating)
        out = prepare_out_dir(out, names, overwrite=args.overwrite, inputs=inputs)
    results["source"] = {**source, "limit_per_group": args.limit}
    print(format_table(results))
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    wrote = f"{out / RESULTS_FILE}" + (f" and {out / GENERATIONS_FILE}" if args.model else "")
    print(f"results written to {wrote}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("openrlhf-lopti eval", main, sys.argv[1:]))
