"""The samples' autoencoder decode falls back to the CPU where the card runs out of memory for it: the image is the
float32 CPU decode's, in the input's dtype and device, the autoencoder back in its dtype, one warning a run; other
errors are raised as before, and the autoencoder's own decode is back after the block."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from flux_trainer.sdscripts.sample_decode import cpu_fallback


class TinyAE(nn.Module):
    """A decode that runs out of memory (`short`) except in float32, as a card short of memory would."""

    def __init__(self, fail: type[BaseException] | None = torch.OutOfMemoryError):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 3, 3, padding=1)
        self.fail = fail
        self.calls: list[torch.dtype] = []

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.conv.weight.dtype)
        if self.fail is not None and self.conv.weight.dtype != torch.float32:
            raise self.fail("CUDA out of memory. Tried to allocate 1024.00 MiB")
        return self.conv(z.to(self.conv.weight.dtype))


def test_out_of_memory_decodes_on_the_cpu_once_said(caplog):
    ae = TinyAE().to(torch.bfloat16)
    z = torch.randn(1, 4, 8, 8).to(torch.bfloat16)
    want = TinyAE(fail=None).to(torch.bfloat16).float().decode(z.float())  # its bf16 weights, in float32
    said = [False]
    with caplog.at_level(logging.WARNING, logger="flux_trainer.runner"), cpu_fallback(ae, said):
        first = ae.decode(z)
        second = ae.decode(z)
    assert first.dtype == torch.bfloat16 and first.shape == (1, 3, 8, 8)
    assert torch.equal(first, want.to(torch.bfloat16)) and torch.equal(second, first)
    assert ae.calls == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]  # the card's, then the CPU's
    assert ae.conv.weight.dtype == torch.bfloat16  # put back as it was
    assert caplog.text.count("ran out of memory for the autoencoder's decode of a 8x8 latent") == 1 and said[0]
    assert "decode" not in ae.__dict__  # the class's own decode again


def test_other_errors_and_a_decode_that_fits_are_left_alone():
    ae = TinyAE(fail=RuntimeError).to(torch.bfloat16)
    with cpu_fallback(ae, [False]), pytest.raises(RuntimeError, match="out of memory"):
        ae.decode(torch.randn(1, 4, 8, 8).to(torch.bfloat16))
    assert ae.calls == [torch.bfloat16] and "decode" not in ae.__dict__
    fits = TinyAE(fail=None)
    z = torch.randn(1, 4, 8, 8)
    with cpu_fallback(fits, [False]):
        assert torch.equal(fits.decode(z), TinyAE(fail=None).decode(z))
    assert fits.calls == [torch.float32]
    with cpu_fallback(None, [False]):  # no autoencoder handed over: nothing to do
        pass
