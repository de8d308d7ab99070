"""Command-line entry points run as modules, e.g. ``python -m openrlhf_lopti.cli.train_ppo_ray``."""
