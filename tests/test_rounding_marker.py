"""The `rounding` marker (tests/conftest.py) that selects what `make test` reruns under another CPU dispatch: a test
comparing floats, itself or through a helper of its module, is marked; a test of messages or exact integers is not."""

import pytest
import torch

from tests import conftest


def _helper_comparing(a, b):
    return torch.allclose(a, b, rtol=1e-6)


def _helper_of_the_helper(a):
    return _helper_comparing(a, a + 1e-9)


def _test_through_two_helpers():
    assert _helper_of_the_helper(torch.ones(2))


def _test_with_a_nested_comparison():
    def check():
        torch.testing.assert_close(torch.ones(2), torch.ones(2))

    check()


def _test_of_a_message():
    with pytest.raises(ValueError, match="eta"):
        raise ValueError("eta must be in (0, 1]")


def _test_of_integers():
    assert int(torch.tensor([1, 2]).sum()) == 3


@pytest.mark.parametrize("function, marked", [
    (_test_through_two_helpers, True), (_test_with_a_nested_comparison, True), (_test_of_a_message, False),
    (_test_of_integers, False),
])  # fmt: skip
def test_a_test_is_marked_when_it_compares_floats_itself_or_through_its_modules_helpers(function, marked):
    import sys

    assert conftest._uses_rounding(function, sys.modules[__name__], set()) is marked


def test_the_shared_bound_helpers_count_as_comparisons():
    from tests import kernel_cases

    assert conftest._uses_rounding(kernel_cases.check_backend_matches_reference, kernel_cases, set())
