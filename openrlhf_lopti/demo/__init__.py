"""The demo and what it builds, apart from the trainer they drive (:mod:`openrlhf_lopti.local`).

- :mod:`.run`: ``openrlhf-lopti demo`` (warm-up, then GRPO / +AR / +Lopti / +AR+Lopti side by side);
- :mod:`.warmup`: the supervised warm-up of the demo's tiny model (the demo, ``audit`` and ``study`` use it);
- :mod:`.tiny_model`: the tiny Llama and tokenizer builders, and ``openrlhf-lopti tiny-model``.

This package may import :mod:`openrlhf_lopti.local`; ``local`` never imports it. Submodules are imported on use,
so importing this package does not import torch or transformers.
"""
