"""K&K reward for verl: ``reward.custom_reward_function.path=<this file>`` (``name=compute_score``, verl's default).

verl loads this file by path and calls ``compute_score(data_source=..., solution_str=<decoded response>,
ground_truth=<label>, extra_info=...)`` per response (its ``naive`` reward manager). The score is the paper's rule
(``openrlhf_lopti.tasks.kk.reward_parts``): format +1 / -1 plus answer +2 / -1.5 / -2, in [-3, 3]; ``acc`` is 1 when
every role is right with a valid format. The ground truth is the ``label`` of ``python -m openrlhf_lopti data kk``
(carried as ``reward_model.ground_truth`` by :mod:`openrlhf_lopti.verl.data`).

Only absolute imports of ``openrlhf_lopti.tasks``: loaded by path, this file is not part of a package.
"""

from openrlhf_lopti.tasks import kk


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None, **kwargs) -> dict:
    """``{"score", "format_reward", "answer_reward", "acc"}`` of one response (verl logs each key)."""
    fmt, answer = kk.reward_parts(solution_str, ground_truth)
    return {"score": fmt + answer, "format_reward": fmt, "answer_reward": answer, "acc": float(answer == 2.0)}
