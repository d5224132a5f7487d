"""Which kernels fit Chroma (sd-scripts' `library/chroma_models.Chroma`, the tiny preset's shapes, on the CPU):
its blocks take their modulation as an argument and trim the text per sample, so they are not FLUX.1's blocks, and
without chroma_blocks (test_chroma_blocks.py: our forward for them) every kernel working inside blocks stays out under
`auto`; flux_prologue (the RoPE table and the timestep frequencies) gives Chroma's forward the same bits as sd-scripts'
own functions."""

from __future__ import annotations

import dataclasses
import importlib
import logging

import pytest
import torch

from flux_trainer.config.random_specs import PRESETS
from flux_trainer.sdscripts.checkout import import_sd_scripts
from tests.integration.tiny_run import CHECKOUT, WHY

pytestmark = pytest.mark.sd_scripts


@pytest.fixture(scope="module")
def chroma():
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    import_sd_scripts(CHECKOUT.path)
    mod = importlib.import_module("library.chroma_models")
    torch.manual_seed(0)
    model = mod.Chroma(dataclasses.replace(mod.chroma_params, **PRESETS["chroma_tiny"]["flux"])).eval()
    return mod, model


def _forward(model):
    """Chroma's forward as sd-scripts' trainer calls it (mod vectors first), on fixed inputs."""
    gen = torch.Generator().manual_seed(1)
    img, txt = torch.randn(2, 16, 64, generator=gen), torch.randn(2, 8, 64, generator=gen)
    img_ids = torch.zeros(2, 16, 3)
    img_ids[..., 1], img_ids[..., 2] = torch.arange(16).float() // 4, torch.arange(16).float() % 4
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8])
    t, g = torch.tensor([0.3, 0.7]), torch.zeros(2)
    with torch.no_grad():
        mods = model.get_mod_vectors(timesteps=t, guidance=g, batch_size=2)
        out = model(
            img, img_ids, txt, torch.zeros(2, 8, 3), t, None, guidance=g, txt_attention_mask=mask, mod_vectors=mods
        )
    return mods, out


def test_chromas_blocks_are_not_taken_for_fluxs(chroma):
    from flux_kernels.patches.blocks import find_blocks

    _, model = chroma
    assert len(model.double_blocks) == 1 and len(model.single_blocks) == 1
    assert find_blocks(model) == ([], [])


def test_auto_leaves_the_block_kernels_out_with_one_line_each(chroma, caplog):
    from flux_kernels.patches import patch
    from flux_kernels.patches.blocks import IN_BLOCKS
    from flux_kernels.runtime.registry import unchecked

    _, model = chroma
    names = ["compile_blocks", "single_qkv", "fp8_matmul", "flux_prologue"]
    sel = unchecked(names)
    auto = type(sel)(sel.installed, {}, None, sel.specs, explicit=False)
    with caplog.at_level(logging.INFO):
        installed = patch.apply_kernels(model, auto)
    assert installed == ["flux_prologue"]
    skipped = [r.getMessage() for r in caplog.records if "no FLUX.1 double/single blocks" in r.getMessage()]
    assert sorted(m.split()[1] for m in skipped) == sorted(n for n in names if n in IN_BLOCKS)
    patch.remove_kernels(model)


def test_flux_prologue_gives_chroma_the_same_bits(chroma):
    from flux_kernels.patches import prologue

    mod, model = chroma
    want_mods, want = _forward(model)
    original = mod.timestep_embedding
    prologue.install(model)
    assert mod.timestep_embedding is prologue.timestep_embedding  # Chroma's own module's function is the one replaced
    got_mods, got = _forward(model)
    prologue.uninstall(model)
    assert mod.timestep_embedding is original
    assert torch.equal(got_mods, want_mods) and torch.equal(got, want)
