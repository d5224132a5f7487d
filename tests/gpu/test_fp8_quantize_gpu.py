"""The fp8 row quantisation kernel (flux_kernels.patches.fp8.quantize_rows_op, Triton) on the GPU: at FLUX's widths the
same scales and e4m3 bits as plain PyTorch's quantize_rows, and compiled fp8 Linears quantising through it
(FLUX_KERNELS_FP8_QUANTIZE=kernel) agree with the fused graph. Skipped without CUDA or triton."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flux_kernels.patches import fp8
from flux_kernels.runtime.registry import FP8_TOLERANCE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


@pytest.mark.parametrize(("rows", "cols"), [(4608, 21504), (4608, 15360), (4096, 12288), (4608, 3072), (512, 1040)])
def test_same_bits_as_quantize_rows_at_flux_widths(rows, cols):
    gen = torch.Generator("cuda").manual_seed(cols)
    x = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16()
    x[:, ::7] *= 1e-4  # values down in e4m3's subnormals
    x[3] = 0
    col = torch.rand(1, cols, device="cuda", generator=gen) + 0.5
    for c in (None, col):
        got8, got_s = fp8.quantize_rows_op(x, c)
        want8, want_s = fp8.quantize_rows(x.float() * c if c is not None else x)
        assert torch.equal(got_s, want_s)
        assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))


def test_compiled_linear_quantising_through_the_kernel_agrees_with_the_fused_graph(monkeypatch):
    """GELU then an fp8 Linear at FLUX's MLP shape, compiled, forward and input gradient: kernel (the Triton kernel
    on the materialised GELU output and gradient) against graph (inductor's fused quantisation, which rounds the
    values it scales before their bf16 rounding, so the two are close, not equal)."""
    gen = torch.Generator("cuda").manual_seed(0)
    w8, scale = fp8.quantize_weight(torch.randn(3072, 12288, device="cuda", generator=gen) * 0.02)
    x = torch.randn(4096, 12288, device="cuda", generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(4096, 3072, device="cuda", generator=gen).bfloat16()

    def f(x):
        return fp8.fp8_linear(torch.nn.functional.gelu(x, approximate="tanh"), w8, scale)

    results = {}
    for mode in ("graph", "kernel"):
        monkeypatch.setattr(fp8, "QUANTIZE", mode)
        monkeypatch.setattr(fp8, "QUANTIZE_IN_GRAPH", mode == "graph")
        torch._dynamo.reset()
        y = torch.compile(f)(x)
        results[mode] = (y, *torch.autograd.grad(y, x, dy))
    torch._dynamo.reset()
    with torch.no_grad():
        want = fp8.reference_linear(torch.nn.functional.gelu(x, approximate="tanh"), w8, scale)
    for got, ref in zip(results["kernel"], results["graph"], strict=True):
        assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < FP8_TOLERANCE
    err = ((results["kernel"][0].float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < FP8_TOLERANCE
