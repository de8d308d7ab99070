"""The one-process trainer: GRPO / REINFORCE++ with AR and Lopti for any local Hugging Face causal LM.

Pipeline per step: ``task`` (puzzles, prompts, reward) -> ``rollout`` (transformers ``generate``) ->
``experience`` (old/ref log-probs, ``advantages``) -> ``update`` (Lopti phases, ``ops.fused_policy_loss``).
``trainer`` adds metrics, checkpoints and plots; ``cli`` is ``openrlhf-lopti train``; ``model`` loads and
saves any local HF model. The demo, its warm-up and the tiny-model builders are not the trainer: they live in
:mod:`openrlhf_lopti.demo`, which imports this package (never the reverse). Submodules are imported on use,
so importing this package does not import transformers.
"""
