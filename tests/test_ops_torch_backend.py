"""The torch backend through ``fused_policy_loss`` runs the shared kernel grid (checks the harness itself)."""

import pytest

from .kernel_cases import CASES, check_backend_matches_reference


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_backend_matches_reference(case):
    check_backend_matches_reference(case, backend="torch")
