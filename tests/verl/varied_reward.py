"""A reward for the end-to-end runs (``reward.custom_reward_function.path``): a tiny random model never answers a
K&K puzzle in format, so the paper's reward is -3 for every response, GRPO's advantages are all 0 and nothing
trains. This one varies across the responses of a prompt (a hash of the text, deterministic), so every step
updates the policy. Loaded by path by verl's reward workers."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return (sum(map(ord, solution_str)) % 101) / 100.0
