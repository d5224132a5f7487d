"""The attention backends: each maps post-RoPE q, k, v [B, H, L, D] and an optional boolean mask [B, H, Lq, Lk]
(True = attend, as sd-scripts builds it) to [B, H, L, D]. SageAttention is listed so the reason is visible, but it has
no backward pass and is never selected for training. `heads_to_tokens` is how the blocks take every backend's output;
which backend runs is the probe's choice (`probe`, `dispatch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_kernels.patches.attention import fa4

SAGE_REASON = "SageAttention has no backward pass (inference only); never selected for training"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    run: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
    requires: str = ""  # importable module it needs ("" = torch only)
    install: str = ""  # what to pip install for it, named where it is missing on a card it would run on
    cuda_only: bool = True
    trainable: bool = True
    note: str = ""
    quadratic: bool = False  # materialises the [B, H, L, L] attention weights (memory grows with L^2)
    sdpa_kind: str | None = None  # an SDPA backend (SDPBackend member name): compiled code gets it from outside
    op: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] | None = None  # custom ops compiled code may call
    min_capability: tuple[int, int] | None = None  # the CUDA compute capability it needs
    # the same attention as tokens [B, L, H*D] without a copy, taking its gradient in any layout (custom ops, so
    # compiled code calls it too); None: `heads_to_tokens` over the [B, H, L, D] output
    tokens: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] | None = None

    @property
    def compilable(self) -> bool:
        """Usable by compiled blocks: PyTorch's SDPA, with the backend set around the compiled call, or a backend
        made of custom ops (traced as they are)."""
        return self.name == "sdpa" or self.sdpa_kind is not None or self.op is not None

    def backend_context(self) -> contextlib.AbstractContextManager:
        """The SDPA backend switch to hold around a compiled block's call (traced under it, the graph calls that
        backend's op). Entering `sdpa_kernel` inside traced code would work too, but puts a call torch's
        AOTAutograd cache cannot key into the graph: every such graph bypassed that cache, in every run."""
        return contextlib.nullcontext() if self.sdpa_kind is None else _sdpa_only(self.sdpa_kind)


@torch.library.custom_op("flux_kernels::heads_to_tokens", mutates_args=())
def heads_to_tokens(x: Tensor) -> Tensor:
    """An attention output [B, H, L, D] as tokens [B, L, H*D] (sd-scripts' "B H L D -> B L (H D)", the same copy), whose
    backward hands the attention a contiguous [B, H, L, D] gradient.

    Why: PyTorch's cuDNN attention caches its backward graph per shape and q/k/v layout but not per layout of the
    incoming gradient (measured on torch 2.11 + cuDNN 9.19, H200): the first backward at a shape fixes the gradient
    layout, and a later call at that shape with the gradient in another layout gets dq/dk/dv that are simply wrong
    (errors of 100% and more), silently. The attention probe runs at the run's shape with a contiguous gradient before
    training, while the gradient of a plain transpose + flatten comes back transposed: the double blocks' attention got
    wrong gradients (the single blocks' v is a view of qkv: another cache entry). With this op every block attention's
    backward gets the probe's layout, on every backend. (The other way round holds too: code that passes another layout
    first at the same shape, such as sd-scripts' own blocks beside these in one process, makes these wrong; training
    never does that.) A custom op rather than an autograd.Function: torch.compile's AOTAutograd cache keys custom ops,
    while an autograd.Function in a graph makes the cache bypass it."""
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format).flatten(2)


@heads_to_tokens.register_fake
def _(x: Tensor) -> Tensor:
    B, H, L, D = x.shape
    return x.new_empty((B, L, H * D))


def _heads_to_tokens_setup(ctx, inputs, output) -> None:
    ctx.heads = inputs[0].shape[1]


def _heads_to_tokens_backward(ctx, grad: Tensor) -> Tensor:
    B, L, _ = grad.shape
    return grad.reshape(B, L, ctx.heads, -1).transpose(1, 2).contiguous()


heads_to_tokens.register_autograd(_heads_to_tokens_backward, setup_context=_heads_to_tokens_setup)


def _sdpa_only(kind: str) -> contextlib.AbstractContextManager:
    """PyTorch's SDPA switched to one of its backends (`kind`, an SDPBackend member name) while held."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, kind)])


def _sdpa_backend(name: str, kind: str, **options) -> AttentionBackend:
    """PyTorch's SDPA restricted to one of its backends (`kind`)."""

    def run(q, k, v, mask):
        with _sdpa_only(kind):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return AttentionBackend(name, run, sdpa_kind=kind, **options)


def _default_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _xformers(q, k, v, mask):
    import xformers.ops as xops

    bias = None
    if mask is not None:  # xformers wants an additive bias whose last dim is padded to a multiple of 8
        B, H, Lq, Lk = mask.shape
        pad = (Lk + 7) // 8 * 8
        bias = q.new_zeros(B, H, Lq, pad)[..., :Lk]
        bias.masked_fill_(~mask, float("-inf"))
    out = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias)
    return out.transpose(1, 2)


def _flash_attn(q, k, v, mask):
    if mask is not None:
        raise NotImplementedError("flash-attn's dense API takes no attention mask")
    from flash_attn import flash_attn_func

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _sage(q, k, v, mask):
    raise NotImplementedError(SAGE_REASON)


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("sdpa", _default_sdpa, cuda_only=False, note="PyTorch's own choice (sd-scripts' path)"),
        _sdpa_backend("sdpa_cudnn", "CUDNN_ATTENTION"),
        _sdpa_backend("sdpa_flash", "FLASH_ATTENTION", cuda_only=False),
        _sdpa_backend("sdpa_efficient", "EFFICIENT_ATTENTION"),
        _sdpa_backend("sdpa_math", "MATH", cuda_only=False, quadratic=True),
        AttentionBackend("xformers", _xformers, requires="xformers"),
        AttentionBackend("flash_attn", _flash_attn, requires="flash_attn"),
        AttentionBackend("sage", _sage, requires="sageattention", trainable=False, note=SAGE_REASON),
        AttentionBackend(
            "cudnn_fa4",
            fa4.cudnn_fa4,
            requires=fa4.MODULE,
            install=fa4.DISTRIBUTION,
            op=fa4.cudnn_fa4,
            min_capability=fa4.MIN_CAPABILITY,
            tokens=fa4.cudnn_fa4_tokens,
            note="cuDNN's forward, FlashAttention-4's backward (flash-attn-4)",
        ),
    )
}


def without_cudnn() -> contextlib.AbstractContextManager:
    """SDPA with every backend but cuDNN's, for sd-scripts' own blocks run beside patched ones at one shape.
    PyTorch's cuDNN attention keys its cached backward without the incoming gradient's layout (`heads_to_tokens`),
    and sd-scripts' blocks hand back another layout than the patched ones: in one process, whichever ran second at
    a shape got wrong gradients. `verify.verify_blocks` runs its reference under this, so the attention probe at the
    verify shape (the patched block's first call there) finds cuDNN as it is."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
