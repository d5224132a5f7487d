"""Fixtures of the GPU tier (tests skip without CUDA through their own marks)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def dev():
    return torch.device("cuda")
