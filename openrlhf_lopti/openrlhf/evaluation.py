"""``LoptiPPOTrainer``: OpenRLHF 0.11.2's ``PPOTrainer`` whose evaluation also logs the reward file's ``scores``.

Upstream's eval logs, per ``datasource``, the mean and best-of-n of the ``rewards``: on K&K those are the paper's
format + answer reward in [-3, 3], so ``eval_kk_3ppl_pass1`` (what ``--ckpt.best_metric_key`` picks when left
empty: the first ``*_pass1`` key) is the 3-person mean reward. Our reward files return ``scores``, 1.0 for a
fully right answer (``tasks/reward_kk.py``, ``tasks/reward_math.py``), so their mean is the accuracy. This adds

    eval_score              mean score over every eval sample (K&K: accuracy over all sizes)
    eval_<datasource>_score mean score per datasource (K&K: per size)

to the same logs (tensorboard / wandb) and to what ``--ckpt.best_metric_key`` can name
(the K&K scripts use ``eval_score``).
"""

import inspect
from collections import defaultdict

import ray

from openrlhf.trainer.ppo_trainer import PPOTrainer, compute_eval_metrics


def eval_metrics_with_scores(eval_dataloader, samples_list, n_samples_per_prompt) -> dict:
    """Upstream's ``compute_eval_metrics`` plus ``eval_score`` and ``eval_<datasource>_score`` (see module doc)."""
    logs = compute_eval_metrics(eval_dataloader, samples_list, n_samples_per_prompt)
    datasource = {}
    for datasources, prompts, _labels, _images in eval_dataloader:
        datasource.update(zip(prompts, datasources))
    scores = defaultdict(list)
    for samples in samples_list:
        if samples.scores is None:
            continue
        for prompt, score in zip(samples.prompts, samples.scores.flatten().tolist()):
            scores[datasource.get(prompt, "unknown")].append(score)
    if scores:
        for name, values in scores.items():
            logs[f"eval_{name}_score"] = sum(values) / len(values)
        every = [value for values in scores.values() for value in values]
        logs["eval_score"] = sum(every) / len(every)
    return logs


@ray.remote
class LoptiPPOTrainer(PPOTrainer.__ray_actor_class__):
    """Upstream's controller; ``evaluate`` logs :func:`eval_metrics_with_scores` instead of upstream's metrics."""

    def evaluate(self, global_step, **generate_kwargs):
        # Upstream's evaluate calls the global name compute_eval_metrics: rebinding it for this call runs its own
        # code (generation, logging) with our metrics. As in LoptiPolicyModelActor, the globals are those the
        # method really uses (a Ray actor process may hold a copy of the module's); a Ray actor runs one
        # method at a time, and the name is restored right after.
        names = inspect.unwrap(super().evaluate).__globals__  # evaluate is wrapped by @torch.no_grad()
        upstream_metrics = names["compute_eval_metrics"]
        names["compute_eval_metrics"] = eval_metrics_with_scores
        try:
            return super().evaluate(global_step, **generate_kwargs)
        finally:
            names["compute_eval_metrics"] = upstream_metrics
