"""`verify_blocks`: the patched blocks checked against sd-scripts' own forward on tiny random inputs, forward and
input gradients, before training relies on them (`patch.apply_kernels` runs it after installing the block ops).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flux_kernels.ops import reference
from flux_kernels.patches.attention.backends import without_cudnn
from flux_kernels.patches.blocks import chroma_kind, patched_blocks


@dataclass
class Modulation:
    """What Chroma's blocks read of sd-scripts' ModulationOut: shift, scale, gate ([B, 1, hidden] each)."""

    shift: Tensor
    scale: Tensor
    gate: Tensor


def _chroma_inputs(block: nn.Module, kind: str, device, dtype, with_mask: bool):
    """Chroma's block arguments as its model passes them: image tokens first, the text trimmed to the longest
    caption (`txt_seq_len`'s max is the text's length), and with the mask two samples, the second's caption shorter
    (padding in the batch)."""
    hidden = block.hidden_size
    gen = torch.Generator().manual_seed(0)
    b, li, lt = (2, 5, 4) if with_mask else (1, 5, 3)
    lens = torch.tensor([lt, 2] if with_mask else [lt], device=device)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    def mod():
        return Modulation(*(rnd(b, 1, hidden, scale=0.5) for _ in range(3)))

    pe = reference.make_pe(b, li + lt, hidden // block.num_heads, device=device, generator=gen)
    if kind == "double":
        return (rnd(b, li, hidden), rnd(b, lt, hidden), pe, [[mod(), mod()], [mod(), mod()]], lens)
    return (rnd(b, li + lt, hidden), pe, mod(), lens)


def _verify_inputs(block: nn.Module, kind: str, device, dtype, with_mask: bool):
    if chroma_kind(block) is not None:
        return _chroma_inputs(block, kind, device, dtype, with_mask)
    hidden = block.hidden_size
    head_dim = hidden // block.num_heads
    gen = torch.Generator().manual_seed(0)
    lt, li = 3, 5

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()

    mask = torch.tensor([[1, 1, 0]], device=device) if with_mask else None
    pe = reference.make_pe(1, lt + li, head_dim, device=device, generator=gen)
    if kind == "double":
        return (rnd(1, li, hidden), rnd(1, lt, hidden), rnd(1, hidden), pe, mask)
    return (rnd(1, lt + li, hidden), rnd(1, hidden), pe, mask)


def verify_blocks(model: nn.Module, tolerance: Mapping[torch.dtype, float] | None = None) -> list[str]:
    """Run the first patched double and single block against its class's own `_forward` (sd-scripts' code) on
    tiny random inputs, with and without a text mask, forward and input gradients. Low-precision blocks run
    under autocast, as sd-scripts trains them (LoRA weights may be fp32, fp8 base weights get upcast). Raises
    ValueError on a mismatch; returns notes for blocks it could not check (sd-scripts' own forward failed)."""
    tolerance = tolerance or {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4}
    notes = []
    double, single = patched_blocks(model)
    for kind, blocks in (("double", double), ("single", single)):
        block = next((b for b in blocks if "_forward" in b.__dict__), None)
        if block is None:
            continue
        p = next(block.parameters())
        dtype = p.dtype if p.dtype in tolerance else torch.bfloat16  # fp8 weights: bf16 activations
        amp = torch.autocast(p.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        with _fp8_held_as(block, dtype):
            notes += _verify_block(block, kind, p.device, dtype, amp, tolerance[dtype])
    return notes


@contextlib.contextmanager
def _fp8_held_as(block: nn.Module, dtype: torch.dtype):
    """The block's fp8 tensors in `dtype` for the block, then fp8 again (bit for bit: every e4m3 value is one in
    bf16). Autocast upcasts fp8 weights at every matmul anyway, and on a CPU that upcast is slow: verifying a
    full-size FLUX double and single block took 5.2 s with fp8 weights against 0.5 s in bf16 (2 threads), ~6 s of
    every start on an fp8 base, where the model is still on the CPU when the kernels go in."""
    fp8 = [t for t in (*block.parameters(), *block.buffers()) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if not fp8:
        yield
        return
    held = [(t, t.data) for t in fp8]
    for t, data in held:
        t.data = data.to(dtype)
    try:
        yield
    finally:
        for t, data in held:
            t.data = data


def _verify_block(block: nn.Module, kind: str, device, dtype, amp, tolerance: float) -> list[str]:
    """verify_blocks for one block: its notes, or ValueError on a mismatch."""
    notes = []
    for with_mask in (False, True):
        args = _verify_inputs(block, kind, device, dtype, with_mask)
        wrt = [a for a in _tensors(args) if a.requires_grad]
        with torch.enable_grad(), amp:
            try:  # not through cuDNN: its backward cache at this shape would then be wrong for the patched block's
                with without_cudnn():  # layout, and the attention probe there (next) would reject it
                    want = _outs_and_grads(type(block)._forward, block, args, wrt)
            except Exception as e:  # noqa: BLE001 - sd-scripts' own forward cannot run here; nothing to compare
                notes.append(f"{kind} block not verified: its original forward failed here ({type(e).__name__})")
                break
            got = _outs_and_grads(block._forward, None, args, wrt)
        for g, w in zip(got, want, strict=True):
            err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-12)).item()
            if not err <= tolerance:
                raise ValueError(
                    f"patched {kind}-stream block differs from sd-scripts' (mask={with_mask}, {dtype}): "
                    f"max rel. error {err:.2e} > {tolerance:.0e}"
                )
    return notes


def _tensors(args) -> list[Tensor]:
    """The tensors among the block's arguments, nested ones (Chroma's modulations) included."""
    if isinstance(args, Tensor):
        return [args]
    if isinstance(args, (list, tuple)):
        return [t for a in args for t in _tensors(a)]
    if isinstance(args, Modulation):
        return [args.shift, args.scale, args.gate]
    return []


def _outs_and_grads(fn, self_or_none, args, wrt) -> list[Tensor]:
    out = fn(self_or_none, *args) if self_or_none is not None else fn(*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(1)
    gouts = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, wrt, gouts))
