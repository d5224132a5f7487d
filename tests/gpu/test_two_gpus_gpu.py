"""Two GPUs (NCCL): coalesced_reduce against sd-scripts' per-tensor all-reduce, through accelerate; the processes'
checkpointing agreement."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import check_two_process_reduce, two_processes
from tests.unit.test_checkpoint_fit import AGREE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL between them)"),
]


def test_two_gpus_through_accelerate_get_sd_scripts_own_averages_bit_for_bit(fm, tmp_path):
    check_two_process_reduce(tmp_path, cuda=True)


def test_two_gpus_agree_on_the_smallest_room_and_the_largest_sizes(tmp_path):
    r0, r1 = two_processes(tmp_path, AGREE, "nccl")
    assert r0 == r1 == (70, {"double": 11, "single": 7}, {"double": 3, "single": 2}, 2)
