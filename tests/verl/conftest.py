"""tests/verl run only in .venv-verl (``make test-verl``): the main suite ignores this folder (pytest.ini)."""

import pytest
import torch

from . import harness


@pytest.fixture(scope="session", autouse=True)
def verl_on_cpu():
    """verl's CPU platform and a one-process gloo group, once per test session (a process has one default group)."""
    harness.init_process_group()
    yield


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama (peaked outputs: sampled tokens span low and high probabilities), its tokenizer, and one GRPO
    batch sampled from it at the paper's K&K temperature 0.7 with a made-up reference for the KL term."""
    path = harness.tiny_model_dir(peak=4.0)
    model, tokenizer = harness.load_tiny(path)
    exp = harness.sample_experience(model, tokenizer, prompts=4, n=4, max_new_tokens=12, temperature=0.7, seed=0,
                                    ref_noise=0.3)  # fmt: skip
    torch.manual_seed(0)
    return {"path": path, "model": model, "tokenizer": tokenizer, "exp": exp, "temperature": 0.7}
