"""flux_prologue on the GPU: the same bits as sd-scripts' embeddings at FLUX's shapes, and no host sync once its
tables exist (sd-scripts' own functions sync: CUDA's sync debug mode, set to error, shows both). Skipped without
CUDA or sd-scripts."""

from __future__ import annotations

import importlib

import pytest
import torch

from flux_kernels.patches import prologue
from tests.conftest import undoing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the syncs it removes are host-device ones)"),
]

AXES, THETA = [16, 56, 56], 10000


def flux_ids(fm, h: int = 64, w: int = 64, txt: int = 512) -> torch.Tensor:
    """1024² at FLUX's packing: 512 text positions (zeros) then the 64 x 64 image grid, as the forward builds ids."""
    img = importlib.import_module("library.flux_utils").prepare_img_ids(1, h, w)
    return torch.cat([torch.zeros(1, txt, 3), img], dim=1).cuda()


@pytest.mark.parametrize("autocast", [False, True])
def test_rope_table_is_sd_scripts_at_flux_shape(fm, autocast):
    ids = flux_ids(fm)
    jitter = flux_ids(fm) + torch.rand(ids.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    embed = fm.EmbedND(sum(AXES), THETA, AXES)
    for x in (ids, jitter):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            want, got = embed(x), prologue.rope_table(x, AXES, THETA)
            # the angles as a float64 product of its own: what autocast does to sd-scripts' einsum, it does not do
            product = torch.cat(
                [x[..., i, None].double() * prologue._omega(d, THETA, "cuda") for i, d in enumerate(AXES)], -1
            )
        assert got.shape == want.shape == (1, 1, 4608, 64, 2, 2) and torch.equal(got, want)
        assert torch.equal(prologue._rotations(product).unsqueeze(1), want) == (x is ids or not autocast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_timestep_embedding_is_sd_scripts(fm, dtype):
    t = torch.rand(4, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(dtype)
    assert torch.equal(prologue.timestep_embedding(t, 256), fm.timestep_embedding(t, 256))


def test_no_host_sync_once_the_tables_exist_where_sd_scripts_syncs(fm):
    ids, t = flux_ids(fm), torch.rand(1, device="cuda")
    kept = prologue.kept_on("cuda", importlib.import_module("library.flux_utils").prepare_img_ids)
    prologue.rope_table(ids, AXES, THETA), prologue.timestep_embedding(t, 256), kept(1, 64, 64)  # build the tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    with undoing(lambda: torch.cuda.set_sync_debug_mode("default")):
        prologue.rope_table(ids, AXES, THETA), prologue.timestep_embedding(t, 256), kept(1, 64, 64)
        with pytest.raises(RuntimeError, match="synchroniz"):
            fm.timestep_embedding(t, 256)  # its frequency table: a pageable host-to-device copy, every call
