"""The cudnn_fa4 attention backend on a GPU with flash-attn-4 (sm90 or newer): cuDNN's forward and FlashAttention-4's
backward against the fp32 math reference at FLUX's shape and at a length that is no multiple of the kernels' tiles,
as close as PyTorch's cuDNN attention gets; compiled and replayed from CUDA graphs as the blocks run it. Skipped
without CUDA, without flash-attn-4 or on an older GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flux_kernels.patches.attention import fa4 as attention_fa4
from flux_kernels.patches.attention import probe as attention_probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        not attention_probe.importable(attention_fa4.MODULE), reason="needs flash-attn-4 (flash_attn.cute)"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < attention_fa4.MIN_CAPABILITY,
        reason="FlashAttention-4's backward needs sm90 or newer",
    ),
]


def _inputs(shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]


def _run(fn, q, k, v, go):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(go)
    return [out.detach()] + [t.grad for t in leaves]


def _cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(1, 24, 4608, 128), (2, 3, 4544, 64)])
def test_as_close_to_fp32_as_cudnn_attention(shape):
    q, k, v, go = _inputs(shape, seed=shape[2])
    with sdpa_kernel(SDPBackend.MATH):
        want = _run(lambda *t: F.scaled_dot_product_attention(*(x.float() for x in t)), q, k, v, go.float())
    got, cudnn = _run(attention_fa4.cudnn_fa4, q, k, v, go), _run(_cudnn, q, k, v, go)
    assert got[0].transpose(1, 2).is_contiguous()  # the output token-major
    assert all(g.is_contiguous() for g in got[1:])
    for g, c, w in zip(got, cudnn, want, strict=True):
        assert g.shape == w.shape and g.dtype == torch.bfloat16
        assert _rel(g, w) <= 1.5 * _rel(c, w) + 1e-3


@pytest.mark.parametrize("shape", [(1, 24, 4608, 128), (2, 3, 4544, 64)])
def test_the_tokens_form_with_q_and_the_gradient_laid_out_as_a_single_block_has_them(shape):
    """As the single blocks call it: q, k and v token-major (cuDNN then writes its output so, and the tokens are a view
    of it), the gradient a column slice of a wider buffer (handed to FlashAttention-4 as it is); against fp32."""
    B, H, L, D = shape
    q, k, v, go = (attention_fa4.token_major(t) for t in _inputs(shape, seed=L + 1))
    with sdpa_kernel(SDPBackend.MATH):
        want = _run(lambda *t: F.scaled_dot_product_attention(*(x.float() for x in t)), q, k, v, go.float())
    cudnn = _run(_cudnn, q, k, v, go)
    wide = torch.zeros(B, L, 2 * H * D, device="cuda", dtype=torch.bfloat16)
    wide[..., : H * D] = go.transpose(1, 2).flatten(2)
    grad = wide[..., : H * D]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    tokens = attention_fa4.cudnn_fa4_tokens(*leaves)
    assert tokens._base is not None  # a view of the op's output
    tokens.backward(grad)
    got = [tokens.detach().unflatten(2, (H, D)).transpose(1, 2)] + [t.grad for t in leaves]
    for g, c, w in zip(got, cudnn, want, strict=True):
        assert _rel(g, w) <= 1.5 * _rel(c, w) + 1e-3


def test_compiled_and_replayed_from_cuda_graphs():
    """A block-like function compiled with CUDA graphs ("reduce-overhead"), attention through the backend's ops:
    several steps on new values of the same shape replay the graphs and match the eager ops."""
    shape = (1, 4, 1000, 128)
    w = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16) / 128**0.5

    def block(q, k, v):
        return attention_fa4.cudnn_fa4(q @ w, k, v).square().mean()

    compiled = torch.compile(block, mode="reduce-overhead")
    for step in range(4):
        q, k, v, _ = _inputs(shape, seed=step)
        got, want = [], []
        for fn, out in ((compiled, got), (block, want)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.compiler.cudagraph_mark_step_begin()
            loss = fn(*leaves)
            loss.backward()
            out += [loss.detach().clone()] + [t.grad.clone() for t in leaves]
        for g, e in zip(got, want, strict=True):
            assert _rel(g, e) < 2e-2
