"""Update direction per probability bin (paper Fig. 3): counts and shares on cases with a known answer."""

import math

import pytest
import torch

from openrlhf_lopti.algo import direction_counts, direction_metrics, sum_direction_counts
from openrlhf_lopti.algo.direction import COUNT_ROWS, direction_bins


def counts_dict(counts: torch.Tensor) -> dict:
    return {name: [int(v) for v in row] for name, row in zip(COUNT_ROWS, counts)}


def test_fixed_bins_and_their_edges():
    p = torch.tensor([1e-6, 0.2499, 0.25, 0.4999, 0.5, 0.7499, 0.75, 1.0], dtype=torch.float64)
    assert direction_bins(p.log()).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert direction_bins(torch.tensor([1e-7])).tolist() == [3]  # log-prob a hair above 0 (rounding): Q4


def test_counts_by_hand():
    # token:       0     1     2     3     4     5     6     7
    p = torch.tensor([0.10, 0.20, 0.30, 0.60, 0.80, 0.90, 0.95, 0.40])
    old = p.log()
    move = torch.tensor([+0.1, -0.1, 0.0, +0.2, -0.01, +0.01, +0.3, +0.5])  # 2: unchanged (a tie)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, 2.0, -0.5, 0.0, 1.0])  # 6: advantage 0
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0])  # 7: not a response token
    got = counts_dict(direction_counts(old, old + move, adv, mask))
    assert got == {
        "tokens": [2, 1, 1, 3],
        "pos": [2, 1, 0, 1],
        "pos_up": [1, 0, 0, 0],  # token 0 rose; 2 did not move; 4 fell
        "neg": [0, 0, 1, 1],
        "neg_down": [0, 0, 0, 0],  # 3 and 5 rose
    }
    m = direction_metrics(direction_counts(old, old + move, adv, mask))
    assert m["direction/pos_up_q1"] == 0.5 and m["direction/pos_up_q2"] == 0.0 and m["direction/pos_up_q4"] == 0.0
    assert "direction/pos_up_q3" not in m  # no positive token in Q3: no share, rather than NaN or 0
    assert "direction/neg_down_q1" not in m and m["direction/neg_down_q3"] == 0.0
    assert [m[f"direction/tokens_q{k}"] for k in (1, 2, 3, 4)] == [2, 1, 1, 3]
    assert [m[f"direction/pos_tokens_q{k}"] for k in (1, 2, 3, 4)] == [2, 1, 0, 1]
    assert all(math.isfinite(v) for v in m.values())


def sgd_step_logprobs(logits: torch.Tensor, labels: torch.Tensor, adv: torch.Tensor, lr: float) -> tuple:
    """One SGD step on the policy-gradient loss ``-sum_t A_t log softmax(logits)[t, label_t]`` (float64);
    returns the log-probs of the labels before and after."""
    z = logits.clone().double().requires_grad_(True)
    before = torch.log_softmax(z, -1).gather(-1, labels[:, None]).squeeze(-1)
    (-(adv.double() * before).sum()).backward()
    with torch.no_grad():
        after = torch.log_softmax(z - lr * z.grad, -1).gather(-1, labels[:, None]).squeeze(-1)
    return before.detach(), after


def test_one_sgd_step_on_a_single_token_raises_exactly_that_token():
    """Each token has its own logits row (independent parameters). Only token 5 has a nonzero advantage:
    an SGD step raises its log-prob and moves no other token."""
    torch.manual_seed(0)
    target_p = torch.tensor([0.1, 0.3, 0.6, 0.9, 0.2, 0.8, 0.4, 0.7])  # two tokens per bin
    labels = torch.zeros(8, dtype=torch.long)
    logits = torch.randn(8, 5)
    # set label 0's logit so that its probability is target_p (the others keep their softmax shares)
    rest = torch.logsumexp(logits[:, 1:], -1)
    logits[:, 0] = rest + torch.log(target_p / (1 - target_p))
    adv = torch.zeros(8)
    adv[5] = 1.0
    old, new = sgd_step_logprobs(logits, labels, adv, lr=0.5)
    assert torch.allclose(old.exp(), target_p.double())
    assert new[5] > old[5] and torch.equal(new[torch.arange(8) != 5], old[torch.arange(8) != 5])

    all_positive = torch.ones(8)
    got = counts_dict(direction_counts(old, new, all_positive))
    assert got["tokens"] == [2, 2, 2, 2] and got["pos"] == [2, 2, 2, 2]
    assert got["pos_up"] == [0, 0, 0, 1]  # token 5 (p = 0.8) alone, in Q4
    m = direction_metrics(direction_counts(old, new, all_positive))
    assert [m[f"direction/pos_up_q{k}"] for k in (1, 2, 3, 4)] == [0.0, 0.0, 0.0, 0.5]


def test_shared_softmax_coupling_matches_the_first_order_formula():
    """Three tokens drawn from ONE softmax p = (0.6, 0.3, 0.1) with labels 0, 1, 2 and advantages +1, +1, -1;
    only label 0's loss is trained (the others have advantage 0 in the step). To first order, the step
    ``dz = lr * (onehot(0) - p)`` changes log p_b by ``lr * (onehot(0) - p) . (onehot(b) - p)``:
    label 0: 1 - 2 p0 + |p|^2 > 0 (rises); label b != 0: -p0 - p_b + |p|^2 < 0 here (falls)."""
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    logits = p.log().expand(3, 3).clone()
    labels = torch.tensor([0, 1, 2])
    z = logits[0].clone().requires_grad_(True)
    (-torch.log_softmax(z, -1)[0]).backward()
    with torch.no_grad():
        shared = torch.log_softmax(z - 1e-3 * z.grad, -1)
    old, new = p.log(), shared[labels]
    sq = float((p * p).sum())
    expected_sign = [1 - 2 * 0.6 + sq, -0.6 - 0.3 + sq, -0.6 - 0.1 + sq]
    assert [bool(v > 0) for v in expected_sign] == [True, False, False]
    assert [bool(v) for v in (new > old)] == [True, False, False]
    assert torch.allclose(new - old, 1e-3 * torch.tensor(expected_sign, dtype=torch.float64), rtol=1e-2)

    got = counts_dict(direction_counts(old, new, torch.tensor([1.0, 1.0, -1.0])))
    # p = 0.1 -> Q1 (negative, fell), 0.3 -> Q2 (positive, fell), 0.6 -> Q3 (positive, rose)
    assert got == {"tokens": [1, 1, 1, 0], "pos": [0, 1, 1, 0], "pos_up": [0, 0, 1, 0], "neg": [1, 0, 0, 0],
                   "neg_down": [1, 0, 0, 0]}  # fmt: skip


def test_micro_batch_and_rank_sums_equal_the_whole_batch():
    torch.manual_seed(1)
    old = -torch.rand(6, 7) * 3
    new = old + 0.1 * torch.randn(6, 7)
    adv = torch.randn(6, 1).expand(6, 7).clone()
    mask = torch.rand(6, 7) > 0.2
    whole = direction_counts(old, new, adv, mask)
    parts = [(old[i : i + 2], new[i : i + 2], adv[i : i + 2], mask[i : i + 2]) for i in (0, 2, 4)]
    rank0, rank1 = sum_direction_counts(parts[:1]), sum_direction_counts(parts[1:])
    assert torch.equal(rank0 + rank1, whole) and whole.dtype == torch.float64
    assert whole[0].sum() == mask.sum()
    assert direction_metrics(rank0 + rank1) == direction_metrics(whole)
    empty = sum_direction_counts([])  # a rank without data still has a tensor to all-reduce
    assert empty.shape == (5, 4) and empty.sum() == 0
    assert set(direction_metrics(empty)) == {f"direction/{k}_q{q}" for k in ("tokens", "pos_tokens", "neg_tokens")
                                             for q in (1, 2, 3, 4)}  # fmt: skip


def test_bad_inputs_name_the_argument():
    old = torch.zeros(4)
    with pytest.raises(ValueError, match="new_log_probs"):
        direction_counts(old, torch.zeros(5), torch.zeros(4))
    with pytest.raises(ValueError, match="mask"):
        direction_counts(old, old, old, torch.ones(2, 2))
    with pytest.raises(ValueError, match="advantages"):
        direction_counts(old, old, torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    # a non-finite value on a masked-out token is ignored
    new = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    counts = direction_counts(old, new, torch.ones(4), torch.tensor([1, 0, 1, 1]))
    assert counts[0].sum() == 3
    with pytest.raises(ValueError, match="counts"):
        direction_metrics(torch.zeros(4, 4))


def test_ties_and_zero_advantages_count_in_no_direction():
    """An unchanged log-prob neither rose nor fell; an advantage of 0 is neither positive nor negative."""
    old = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.6, 0.9]).log()
    new = old + torch.tensor([0.0, -0.1, 0.0, 0.1, -0.1, -0.1])
    adv = torch.tensor([-1.0, 0.0, -0.5, 0.5, 0.0, -0.5])
    got = counts_dict(direction_counts(old, new, adv))
    # Q1: a negative tie and a zero-advantage fall; Q2: a negative tie and a positive rise; Q3: a zero-advantage
    # fall; Q4: a negative fall
    assert got == {"tokens": [2, 2, 1, 1], "pos": [0, 1, 0, 0], "pos_up": [0, 1, 0, 0], "neg": [1, 1, 0, 1],
                   "neg_down": [0, 0, 0, 1]}  # fmt: skip


def test_metrics_are_shares_of_the_bins_counts():
    counts = torch.tensor([[5.0, 4, 3, 2], [4, 0, 1, 0], [1, 0, 1, 0], [2, 3, 0, 1], [1, 3, 0, 0]], dtype=torch.float64)
    metrics = direction_metrics(counts)
    assert metrics["direction/pos_up_q1"] == 0.25 and metrics["direction/pos_up_q3"] == 1.0
    assert metrics["direction/neg_down_q1"] == 0.5 and metrics["direction/neg_down_q2"] == 1.0
    assert metrics["direction/neg_down_q4"] == 0.0
    assert "direction/pos_up_q2" not in metrics and "direction/neg_down_q3" not in metrics  # empty: no share
    assert metrics["direction/tokens_q1"] == 5 and metrics["direction/neg_tokens_q2"] == 3


def test_error_messages_start_with_the_argument():
    old = torch.zeros(4)
    bad = torch.tensor([0.0, float("inf"), 0.0, 0.0])
    cases = [
        ((old, torch.zeros(5), old), "new_log_probs must have old_log_probs' shape"),
        ((old, old, torch.zeros(3)), "advantages must have old_log_probs' shape"),
        ((old, old, old, torch.ones(5)), "mask must have old_log_probs' shape"),
        ((bad, old, old), "old_log_probs has non-finite values"),
        ((old, bad, old), "new_log_probs has non-finite values"),
        ((old, old, bad), "advantages has non-finite values"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=f"^{message}"):
            direction_counts(*args)
    assert sum_direction_counts([]).dtype == torch.float64


def test_summed_counts_go_to_the_requested_device():
    # "meta" is a second device on every machine: the counts are moved there, empty or not
    empty = sum_direction_counts([], device="meta")
    assert empty.device.type == "meta" and empty.dtype == torch.float64 and empty.shape == (5, 4)
    old = torch.tensor([0.1, 0.6]).log()
    summed = sum_direction_counts([(old, old + 0.1, torch.ones(2))], device="meta")
    assert summed.device.type == "meta" and summed.shape == (5, 4)
    assert sum_direction_counts([(old, old + 0.1, torch.ones(2))]).device.type == "cpu"
