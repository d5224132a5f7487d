"""coalesced_reduce on two GPUs: NCCL through accelerate, against sd-scripts' per-tensor all-reduce."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import check_two_process_reduce

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL between them)"),
]


def test_two_gpus_through_accelerate_get_sd_scripts_own_averages_bit_for_bit(fm, tmp_path):
    check_two_process_reduce(tmp_path, cuda=True)
