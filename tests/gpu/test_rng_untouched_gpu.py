"""On the GPU, where compiled blocks replay from CUDA graphs: installing `auto` (graph_record's probe, verification),
the first forward (the attention probe) and the graphs' warm-up, recording and replay draw nothing from torch's CPU
or CUDA generators or from Python's `random`. sd-scripts' shuffled DataLoader seeds itself from the CPU generator
once training iterates, its noise and timesteps come from the CUDA one: a kernel that drew from either gives
kernels=auto other batches or noise than kernels=off with the same seed (graph_record's probe once did). The CPU
half of this is tests/unit/test_kernels_compile_blocks.py. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from flux_kernels.patches import patch
from flux_kernels.runtime import registry
from tests.conftest import tiny_flux, tiny_flux_forward, undoing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")]


def _states():
    return torch.get_rng_state(), torch.cuda.get_rng_state(), random.getstate()


def test_auto_with_cuda_graphs_draws_nothing_from_the_runs_random_streams(fm, tmp_path, monkeypatch):
    monkeypatch.setenv("FLUX_KERNELS_CACHE", str(tmp_path / "attention.json"))
    model = tiny_flux(fm).cuda()
    model.requires_grad_(False).img_in.requires_grad_(True)
    torch.manual_seed(3)
    random.seed(3)
    before = _states()
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        graphs = {"compile_blocks": {"options": {"triton.cudagraphs": True}}}  # as the runner asks for them
        installed = patch.apply_kernels(model, registry.select("auto", "cuda"), options=graphs)
        for _ in range(3):  # warm-up, recording, replay
            for p in model.img_in.parameters():
                p.grad = None
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = tiny_flux_forward(model, device="cuda").float().square().mean()
            loss.backward()
        torch.cuda.synchronize()
    assert "compile_blocks" in installed and "attention" in installed
    after = _states()
    assert torch.equal(after[0], before[0]), "torch's CPU generator moved"
    assert torch.equal(after[1], before[1]), "torch's CUDA generator moved"
    assert after[2] == before[2], "Python's random moved"
