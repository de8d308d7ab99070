r"""Evaluation: K&K accuracy per number of people, math accuracy per benchmark (greedy or avg@k).

From a jsonl of generations:

    python -m openrlhf_lopti.tasks.evaluate --task kk --generations gens.jsonl [--out results.json]

or by generating with a local model (transformers `generate`; needs transformers installed) on a
prompt file written by `openrlhf-lopti data`:

    python -m openrlhf_lopti.tasks.evaluate --task kk --model path/to/model --data data/kk/test.jsonl \
        --n-samples 1 --max-new-tokens 4096 --save-generations gens.jsonl

Generations file: one JSON object per line with `label` (K&K: solution_text_format; math: the answer),
`responses` (list of strings) or `response` (one string), and the group key: `num_people` for K&K
(taken from the label's line count when absent), `benchmark` (or `datasource`) for math. Lines with the
same `id` (else the same `prompt`) are merged, so one line per sample works too.

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
import sys
from collections.abc import Iterable
from pathlib import Path

from openrlhf_lopti.tasks import kk
from openrlhf_lopti.tasks import math as math_task
from openrlhf_lopti.tasks import messages_to_text, read_rows, write_jsonl

__all__ = ["build_parser", "evaluate", "format_table", "generate_local", "main"]


def _merge(records: Iterable[dict]) -> list[dict]:
    """One entry per prompt with all its responses (records sharing `id`, else `prompt`, are merged)."""
    merged: dict[str, dict] = {}
    for i, rec in enumerate(records):
        if "responses" in rec:
            responses = list(rec["responses"])
        elif "response" in rec:
            responses = [rec["response"]]
        else:
            raise ValueError(f"record {i} has neither 'responses' nor 'response'")
        if "label" not in rec:
            raise ValueError(f"record {i} has no 'label'")
        if "id" in rec:
            key = f"id:{rec['id']}"
        elif "prompt" in rec:
            key = "prompt:" + json.dumps(rec["prompt"], sort_keys=True)
        else:
            key = f"line:{i}"
        entry = merged.setdefault(key, {**rec, "responses": []})
        entry["responses"].extend(str(r) for r in responses)
    return list(merged.values())


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


def evaluate(records: Iterable[dict], task: str) -> dict:
    """Metrics per group (K&K: number of people; math: benchmark) and their average; see module doc."""
    if task not in ("kk", "math"):
        raise ValueError(f"task must be 'kk' or 'math', got {task!r}")
    score, group_of = (_score_kk, _kk_group) if task == "kk" else (_score_math, _math_group)
    groups: dict[str, list[list[dict[str, float]]]] = {}
    for rec in _merge(records):
        if not rec["responses"]:
            continue
        scored = [score(r, rec["label"]) for r in rec["responses"]]
        groups.setdefault(group_of(rec), []).append(scored)

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
    matching OpenRLHF's `--data.apply_chat_template`. temperature 0 means greedy decoding.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    p = argparse.ArgumentParser(prog="openrlhf-lopti eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("kk", "math"), required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--generations", help="jsonl of generations (see module docstring)")
    src.add_argument("--model", help="local Hugging Face model to generate with (needs --data)")
    p.add_argument("--data", help="prompt jsonl written by `openrlhf-lopti data` (with --model)")
    p.add_argument("--n-samples", type=int, default=1, help="samples per prompt (avg@k); 1 = greedy")
    p.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy) for 1 sample, else 1.0")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-generations", help="write the generated responses to this jsonl")
    p.add_argument("--out", help="results JSON (default: next to the input, <name>.<task>_eval.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `openrlhf-lopti eval` / `python -m openrlhf_lopti.tasks.evaluate`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model:
        if not args.data:
            parser.error("--model needs --data (a prompt jsonl)")
        records = read_rows(args.data)[: args.limit]
        temperature = args.temperature if args.temperature is not None else (0.0 if args.n_samples == 1 else 1.0)
        responses = generate_local(
            args.model,
            [r["prompt"] for r in records],
            n_samples=args.n_samples,
            temperature=temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            seed=args.seed,
        )
        records = [{**r, "responses": rs} for r, rs in zip(records, responses)]
        if args.save_generations:
            write_jsonl(args.save_generations, records)
        source = Path(args.data)
    else:
        records = read_rows(args.generations)[: args.limit]
        source = Path(args.generations)

    results = evaluate(records, args.task)
    print(format_table(results))
    out = Path(args.out) if args.out else source.with_name(f"{source.stem}.{args.task}_eval.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
