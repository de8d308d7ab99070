"""A real `python -m openrlhf_lopti train` killed with SIGKILL after its first checkpoint resumes and loses at
most one step: no step is missing or logged twice, and the steps before the kill are kept, not redone."""

import os
import signal
import subprocess
import sys
import time

import torch

from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.demo.warmup import supervised_warmup
from openrlhf_lopti.local.checkpoint import CHECKPOINT_FILE, load_checkpoint
from openrlhf_lopti.local.model import save_model
from openrlhf_lopti.runs import read_metrics


def train_command(*args):
    return [sys.executable, "-m", "openrlhf_lopti", "train", "--threads", "1", "--no-progress", *args]


def test_sigkill_then_resume(tmp_path):
    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    torch.manual_seed(0)
    supervised_warmup(model, tok, 30, batch_size=16, lr=1e-2, progress=False)
    save_model(model, tok, tmp_path / "model", prompt_style="compact")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = ["--out", str(out), "--prompts-per-step", "2", "--n-samples", "2", "--max-new-tokens", "16",
            "--mini-batch-size", "4", "--loss-backend", "torch", "--method", "ar+lopti"]  # fmt: skip

    # 1000 steps would take minutes: the kill lands long before the end.
    proc = subprocess.Popen(
        train_command("--model", str(tmp_path / "model"), "--steps", "1000", *args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 300  # a hang guard: the first checkpoint comes within seconds, more when busy
    try:
        while not (out / CHECKPOINT_FILE).exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
        time.sleep(0.3)  # let it get into a later step
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    done = load_checkpoint(out)["step"]
    logged = read_metrics(out / "metrics.jsonl")
    assert 1 <= done < 1000
    assert [r["step"] for r in logged][:done] == list(range(1, done + 1))
    assert len(logged) - done <= 1  # at most the step in flight is lost

    target = done + 2
    result = subprocess.run(train_command("--resume", "--steps", str(target), *args), capture_output=True, env=env,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout.decode()[-3000:] + result.stderr.decode()[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, target + 1))  # none missing, none twice
    assert rows[:done] == logged[:done]  # the checkpointed steps were kept, not recomputed
    assert load_checkpoint(out)["step"] == target
    assert (out / "final_model" / "config.json").exists()
