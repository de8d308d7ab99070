"""The one-process trainer: GRPO / REINFORCE++ with AR and Lopti for any local Hugging Face causal LM.

Pipeline per step: ``task`` (puzzles, prompts, reward) -> ``rollout`` (transformers ``generate``) ->
``experience`` (old/ref log-probs, ``advantages``) -> ``update`` (Lopti phases, ``ops.fused_policy_loss``).
``trainer`` adds metrics, checkpoints and plots; ``cli`` is ``openrlhf-lopti train``, ``demo`` is
``openrlhf-lopti demo`` (``model`` and ``warmup`` build its tiny model). Submodules are imported on use,
so importing this package does not import transformers.
"""
