"""memory.checkpoint_skip=auto on CUDA with sd-scripts' own Flux: the measured activations are real (each measured
block grows allocated memory), the blocks that fit keep them, the measured growth predicts the next step's peak,
and gradients equal the all-checkpointed ones. Skipped without CUDA or an sd-scripts checkout."""

from __future__ import annotations

import pytest
import torch

from flux_trainer.sdscripts.checkpoint_fit import GIB, CheckpointFit, DeviceMemory
from tests.conftest import tiny_flux

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA memory figures")]


def step(flux, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    img, txt = torch.randn(1, 1024, 64, generator=g, device=dev), torch.randn(1, 64, 64, generator=g, device=dev)
    ids = torch.zeros(1, 1024, 3, device=dev), torch.zeros(1, 64, 3, device=dev)
    y, t = torch.randn(1, 64, generator=g, device=dev), torch.rand(1, generator=g, device=dev)
    out = flux(
        img=img, img_ids=ids[0], txt=txt, txt_ids=ids[1], timesteps=t, y=y, guidance=torch.full((1,), 3.5, device=dev)
    )
    out.square().mean().backward()
    grads = [p.grad.clone() for p in flux.parameters() if p.grad is not None]
    flux.zero_grad(set_to_none=True)
    return grads


def test_auto_measures_real_activations_and_keeps_what_fits(fm):
    flux = tiny_flux(fm, depth=3, depth_single_blocks=5).cuda().train()
    flux.enable_gradient_checkpointing()
    reference = step(flux)

    fit = CheckpointFit("auto", memory=DeviceMemory("cuda"))
    assert fit.start(flux) is None and fit.kept == 2
    torch.cuda.reset_peak_memory_stats()
    first = step(flux)
    assert set(fit.per_block) == {"double", "single"} and min(fit.per_block.values()) > 1e6, fit.per_block
    before = torch.cuda.max_memory_allocated()
    line = fit.decide()
    assert fit.kept == fit.total == 8, line  # an H200 holds every tiny block's activations
    torch.cuda.reset_peak_memory_stats()
    second = step(flux)
    grown = torch.cuda.max_memory_allocated() - before
    expected = 4 * fit.per_block["single"] + 2 * fit.per_block["double"]  # the six more: 4 single, 2 double blocks
    assert 0.5 * expected < grown < 1.5 * expected, (grown / GIB, expected / GIB, fit.per_block)
    for a, b, c in zip(reference, first, second, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)
