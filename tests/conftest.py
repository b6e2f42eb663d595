"""Shared test fixtures (keep small)."""

import pytest
import torch


@pytest.fixture
def torch_seed() -> int:
    """Seed torch's global RNG with 0 for a deterministic test; returns the seed."""
    torch.manual_seed(0)
    return 0
