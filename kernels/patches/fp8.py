"""fp8 frozen matmuls: the frozen Linear layers of the FLUX blocks multiply in fp8 on the tensor cores
(`torch._scaled_mm`, e4m3, one scale per row) instead of upcasting their weights to bf16 for every matmul.

    y  = x @ W^T + b        forward:  x quantised per row (amax / 448), W kept in fp8 with one scale per output
                                      row, bf16 out; the bias is added outside, where torch.compile fuses it
                                      with the LoRA add that follows
    dx = dy @ W             backward: dy * (W's row scales) quantised per row, W transposed in fp8 (a transient
                                      copy, half the bytes of the bf16 upcast it replaces); W itself is frozen

Where the weights come from:
  * an fp8 base (sd-scripts' fp8_base: `unet.to(float8_e4m3fn)`, no scales): the stored fp8 values are used as
    they are (scale 1), so the only new rounding is of the activations and the incoming gradient;
  * a bf16/fp32 base: each weight is quantised once at install to e4m3 with a scale per output row and the
    high-precision copy is released (about half the weight memory). This changes the frozen model's numbers,
    so it happens only when `fp8_matmul` is asked for by name.

`reference_linear` is the computation fp8 replaces (what sd-scripts does under autocast: dequantised weight,
bf16 matmul); `fp8_linear` must agree with it within fp8 rounding, forward and backward (registry probe, tests).
Both matmuls are custom ops (`flux_kernels::fp8_mm` with its autograd formula, `flux_kernels::fp8_dgrad`): that
is what lets torch.compile recompute them under sd-scripts' gradient checkpointing instead of keeping their outputs
(see fp8_mm). Rows up to WIDE_ROWS wide: inside torch.compile (kernels=auto compiles the blocks) the forward
quantisation is plain PyTorch in the graph, fused by inductor into the op producing the activations
(`fp8_mm_quantized`), and run eagerly it happens inside fp8_mm as one compiled kernel; the backward's is plain
PyTorch in the backward graph, where inductor fuses it with the op producing the gradient. Wider rows (FLUX's MLP
and single-block activations and gradients, 9216-21504 wide) go through `quantize_rows_op`, a Triton kernel of their
own, forward and backward (FLUX_KERNELS_FP8_QUANTIZE, quantize_mode_from).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from flux_kernels.patches.lora_norms import wrapper_of

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16  # _scaled_mm: the contracted and the output dimension are multiples of 16
ATTR = "_flux_fp8"
SCALE = "_flux_fp8_scale"  # a quantised weight's row scales [N] fp32: a non-persistent buffer of its Linear
TRANSPOSED = "_flux_fp8_t"  # with keep_transposed: the fp8 weight's transpose [K, N], a non-persistent buffer too


QUANTIZE_MODES = ("graph", "op", "kernel", "wide")
WIDE_ROWS = 4096  # with "wide": rows wider than this go through quantize_rows_op


def quantize_mode_from(env: Mapping[str, str] = os.environ) -> str:
    """How activations and incoming gradients are quantised (FLUX_KERNELS_FP8_QUANTIZE), to measure the ways against
    each other in whole runs:
      graph   under torch.compile, plain PyTorch in the graph that inductor fuses into the op producing the tensor;
              eagerly, the activations inside the matmul op (one compiled kernel)
      op      the activations always inside the matmul op; the gradients as with graph
      kernel  both through quantize_rows_op, a Triton kernel of its own over the materialised tensor
      wide    (the default) kernel for rows wider than WIDE_ROWS, graph for the others: inductor fuses a narrow
              row's amax into its producer as a persistent reduction, but a wide row's into a looped reduction
              that sweeps it twice, and the separate kernel is faster there (H200, FLUX: 298.9 against 304.8 ms
              of device time a step; see the README)"""
    mode = env.get("FLUX_KERNELS_FP8_QUANTIZE", "wide").strip().lower()
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"FLUX_KERNELS_FP8_QUANTIZE={mode!r}: expected one of {', '.join(QUANTIZE_MODES)}")
    return mode


def quantize_in_graph_from(env: Mapping[str, str] = os.environ) -> bool:
    """Under torch.compile: quantise the activations in the graph (fused with their producer), not inside the op."""
    return quantize_mode_from(env) in ("graph", "wide")


QUANTIZE = quantize_mode_from()
QUANTIZE_IN_GRAPH = quantize_in_graph_from()


def quantize_by_kernel(width: int) -> bool:
    """Whether rows this wide go through quantize_rows_op (QUANTIZE)."""
    return QUANTIZE == "kernel" or (QUANTIZE == "wide" and width > WIDE_ROWS)


def fp8_capable(capability: tuple[int, int] | None) -> bool:
    """fp8 tensor cores: Ada (sm_89), Hopper (sm_90) and newer."""
    return capability is not None and tuple(capability) >= (8, 9)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (x8 [M, K] e4m3, scale [M, 1] fp32) with x ~= x8 * scale; each row's amax maps to 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax * (1.0 / E4M3_MAX)  # as CUDA divides by a scalar (and inductor too): the same bits on every device
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def _out_dtype(x: Tensor) -> torch.dtype:
    """What F.linear would return here: the autocast dtype inside autocast, else the input's dtype."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _scaled_mm(a8: Tensor, sa: Tensor, b8_t: Tensor, sb: Tensor, fast_accum: bool) -> Tensor:
    """a8 [M, K] row-major times b8_t [K, N] column-major, per-row scales sa [M, 1] and sb [1, N]; bf16 out.
    `fast_accum` (Hopper: no periodic promotion of the fp8 accumulator) for the forward only, as torchao's float8
    training does; gradients accumulate exactly."""
    return torch._scaled_mm(a8, b8_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


TRANSPOSE_TILE = (64, 64)  # bytes: rows x columns of one program's tile


def transpose(w8: Tensor) -> Tensor:
    """w8 [R, C] (1-byte elements) -> its transpose [C, R], contiguous: a tiled Triton copy where Triton runs (see
    tl_transpose), PyTorch's strided copy elsewhere. Bit-exact either way: only bytes move."""
    from flux_kernels.runtime.device import triton_runs_on

    if w8.dim() != 2 or w8.element_size() != 1 or not triton_runs_on(w8):
        return w8.t().contiguous()
    import triton

    from flux_kernels.ops.tl_transpose import transpose_2d

    src = w8.contiguous().view(torch.uint8)
    rows, cols = src.shape
    out = torch.empty((cols, rows), dtype=torch.uint8, device=w8.device)
    br, bc = TRANSPOSE_TILE
    transpose_2d[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](src, out, rows, cols, BLOCK_R=br, BLOCK_C=bc)
    return out.view(w8.dtype)


@torch.library.custom_op("flux_kernels::fp8_dgrad", mutates_args=())
def fp8_dgrad(g8: Tensor, sg: Tensor, w8: Tensor, wt8: Tensor | None = None) -> Tensor:
    """dx = (g8 * sg) @ W8, bf16: W8 [N, K] transposed in fp8 right here, the operand _scaled_mm needs, unless its
    transpose `wt8` [K, N] is kept (install's keep_transposed). A custom op so torch.compile cannot hoist the
    transpose into the forward graph and keep one transposed copy of every weight alive until backward (measured:
    +12 GiB on FLUX at fp8 base, when it was plain PyTorch)."""
    wt8 = transpose(w8) if wt8 is None else wt8
    return _scaled_mm(g8, sg, wt8.t(), torch.ones(1, w8.shape[1], device=g8.device), fast_accum=False)


@fp8_dgrad.register_fake
def _(g8: Tensor, sg: Tensor, w8: Tensor, wt8: Tensor | None = None) -> Tensor:
    return g8.new_empty((g8.shape[0], w8.shape[1]), dtype=torch.bfloat16)


def quantize_launch(k: int) -> tuple[int, int]:
    """tl_quantize's (columns per sweep step, warps) for rows k wide: the fastest measured on an H200 at FLUX's
    widths (4608 x 21504: 102 us at 4096/16 against 119 at 2048/8; 15360 and 12288 wide: 2048/8; 3072: 1024/4,
    15 us against 19). Fewer, wider programs keep the rows of the second sweep in L2. Retested 2026-11-23: the
    launches fastest on cold inputs (2048/16 up to 10240 wide, 4096/16, 4096/32 over 16384; 3.3 of 18.9 ms less a
    step in isolation) ran whole vram80 fp8 steps no faster (0.2950, 0.2942 against 0.2936, 0.2930 s), so not used."""
    if k <= 4096:
        return 1024, 4
    return (2048, 8) if k <= 16384 else (4096, 16)


@torch.library.custom_op("flux_kernels::quantize_rows", mutates_args=())
def quantize_rows_op(x: Tensor, col: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """quantize_rows(x.float() * col) for a 2-D x (col: one fp32 scale per column, or None) as one Triton kernel
    that reads x from DRAM once (tl_quantize), plain PyTorch where Triton does not run. A custom op, so inside
    torch.compile it stays a kernel of its own over the materialised x, instead of the row reduction inductor
    fuses into x's producer (for wide rows a looped reduction sweeping each row twice, which measured slower than
    the producer alone plus this kernel)."""
    from flux_kernels.runtime.device import triton_interpreting, triton_runs_on

    if not triton_runs_on(x):
        return quantize_rows(x.float() * col.reshape(1, -1) if col is not None else x)
    from flux_kernels.ops.tl_quantize import quantize_rows_2d

    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    out = torch.empty((rows, k), dtype=E4M3, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    col_flat = None if col is None else col.reshape(-1).float().contiguous()
    block, warps = quantize_launch(k)
    quantize_rows_2d[(rows,)](
        x, x if col_flat is None else col_flat, out, scale, k, x.stride(0), E4M3_MAX=E4M3_MAX,
        HAS_COL=col_flat is not None, BLOCK=block, RTNE=triton_interpreting(), num_warps=warps,
    )  # fmt: skip
    return out, scale


@quantize_rows_op.register_fake
def _(x: Tensor, col: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], 1), dtype=torch.float32)


_quantize_compiled = None


def _quantize_in_op(x2: Tensor) -> Tensor:
    """quantize_rows inside the forward op: one compiled kernel on a GPU (eager it is four passes over x and the fp8
    matmul loses its lead), plain PyTorch elsewhere."""
    global _quantize_compiled
    if x2.device.type != "cuda":
        return quantize_rows(x2)
    if _quantize_compiled is None:
        _quantize_compiled = torch.compile(quantize_rows, dynamic=True)
    return _quantize_compiled(x2)


@torch.library.custom_op("flux_kernels::fp8_mm", mutates_args=())
def fp8_mm(x2: Tensor, w8: Tensor, sw: Tensor, wt8: Tensor | None = None) -> Tensor:
    """x2 [M, K] (bf16/fp32) @ (W8 [N, K] * sw [1, N])^T in fp8, bf16 out. A custom op, not an autograd.Function
    around plain ops: inside sd-scripts' gradient checkpointing, torch.compile's partitioner does not recompute a
    _scaled_mm traced from an autograd.Function (compute-intensive, and not tagged as checkpointed) and kept every
    block's matmul outputs until backward (measured: +12.5 GiB at fp8 base); an op traced under the checkpoint is
    recomputed like the rest of the block. `wt8`, W8's kept transpose or None, is only for the backward."""
    x8, sx = _quantize_in_op(x2)
    return _scaled_mm(x8, sx, w8.t(), sw, fast_accum=True)


@fp8_mm.register_fake
def _(x2: Tensor, w8: Tensor, sw: Tensor, wt8: Tensor | None = None) -> Tensor:
    return x2.new_empty((x2.shape[0], w8.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("flux_kernels::fp8_mm_quantized", mutates_args=())
def fp8_mm_quantized(x2: Tensor, x8: Tensor, sx: Tensor, w8: Tensor, sw: Tensor, wt8: Tensor | None = None) -> Tensor:
    """fp8_mm with the activations quantised by the caller (x8, sx = quantize_rows(x2)), for compiled graphs: there
    the quantisation is plain PyTorch that inductor fuses into the op producing x2 (LayerNorm + modulation, GELU,
    the attention output's reshape) instead of a separate pass re-reading x2. x2 is an input only for autograd:
    the gradient flows to it as if the matmul had read it (fp8 rounding is not differentiated, as in fp8_mm)."""
    return _scaled_mm(x8, sx, w8.t(), sw, fast_accum=True)


@fp8_mm_quantized.register_fake
def _(x2: Tensor, x8: Tensor, sx: Tensor, w8: Tensor, sw: Tensor, wt8: Tensor | None = None) -> Tensor:
    return x2.new_empty((x2.shape[0], w8.shape[0]), dtype=torch.bfloat16)


def _fp8_mm_setup(ctx, inputs, output) -> None:
    x2, *_, w8, sw, wt8 = inputs  # fp8_mm: (x2, w8, sw, wt8); fp8_mm_quantized: (x2, x8, sx, w8, sw, wt8)
    ctx.save_for_backward(w8, sw, wt8)
    ctx.x_dtype = x2.dtype
    ctx.n_inputs = len(inputs)


def _fp8_mm_backward(ctx, dy: Tensor):
    w8, sw, wt8 = ctx.saved_tensors
    # dy @ (diag(sw) W8) = (dy * sw) @ W8: the row scales folded into dy before it is quantised; for narrow rows
    # plain PyTorch, which inductor fuses with whatever produced dy, for wide ones the Triton row kernel
    g8, sg = quantize_rows_op(dy, sw) if quantize_by_kernel(dy.shape[-1]) else quantize_rows(dy.float() * sw)
    return (fp8_dgrad(g8, sg, w8, wt8).to(ctx.x_dtype),) + (None,) * (ctx.n_inputs - 1)


fp8_mm.register_autograd(_fp8_mm_backward, setup_context=_fp8_mm_setup)
fp8_mm_quantized.register_autograd(_fp8_mm_backward, setup_context=_fp8_mm_setup)


def fp8_linear(
    x: Tensor, w8: Tensor, w_scale: Tensor | None = None, bias: Tensor | None = None, w8_t: Tensor | None = None
) -> Tensor:
    """F.linear(x, w8 * w_scale[:, None], bias) with the matmul in fp8 (forward and input gradient). Traced by
    torch.compile, the activation quantisation is left in the graph for inductor to fuse with x's producer;
    run eagerly, it happens inside fp8_mm as one compiled kernel. `w8_t`: w8's transpose, kept, so the input
    gradient does not transpose w8 again (same bytes, same result)."""
    n, k = w8.shape
    sw = torch.ones(1, n, device=x.device) if w_scale is None else w_scale.to(x.device, torch.float32).view(1, n)
    x2 = x.reshape(-1, k)
    if quantize_by_kernel(k):
        x8, sx = quantize_rows_op(x2.detach())
        y = fp8_mm_quantized(x2, x8, sx, w8, sw, w8_t)
    elif QUANTIZE_IN_GRAPH and torch.compiler.is_compiling():
        x8, sx = quantize_rows(x2.detach())
        y = fp8_mm_quantized(x2, x8, sx, w8, sw, w8_t)
    else:
        y = fp8_mm(x2, w8, sw, w8_t)
    y = y.to(_out_dtype(x)).view(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


def reference_linear(x: Tensor, w8: Tensor, w_scale: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """The plain computation: dequantise the weight to the activation dtype and multiply (sd-scripts' fp8_base
    path under autocast: the fp8 weight upcast for every matmul)."""
    dtype = _out_dtype(x)
    w = w8.to(torch.float32) if w_scale is None else w8.to(torch.float32) * w_scale.view(-1, 1).float()
    return torch.nn.functional.linear(x.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype))


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """A high-precision weight [N, K] -> (e4m3 [N, K], fp32 scale [N]), one scale per output row."""
    w8, s = quantize_rows(w)
    return w8, s.view(-1)


# ---- installing into a model --------------------------------------------------------------------------------------


class Fp8Forward:
    """The frozen path of one Linear in fp8: a callable that replaces `Linear.forward`, or, where a LoRA module
    wraps the Linear (sd-scripts' LoRAModule keeps the original as `org_forward`), that `org_forward`. A quantised
    weight's row scales are a buffer of the Linear (SCALE), so they go wherever the model is moved: sd-scripts
    loads the model on the CPU and moves it to the GPU after the kernels are installed, and a scale kept here
    stayed behind (measured on the H200: a pageable host-to-device copy and a sync for each of the 228 fp8 matmuls
    of a step, and compiled graphs with a CPU input cannot replay from CUDA graphs)."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: Tensor) -> Tensor:
        lin = self.linear
        return fp8_linear(x, lin.weight, lin._buffers.get(SCALE), lin.bias, lin._buffers.get(TRANSPOSED))


def block_linears(blocks: list[nn.Module]) -> list[tuple[str, nn.Linear]]:
    """The Linear layers of the blocks that see every token (qkv, proj, MLP, linear1/2): not the modulation
    layers, whose input is one row per image."""
    out = []
    for i, block in enumerate(blocks):
        for name, m in block.named_modules():
            if isinstance(m, nn.Linear) and "mod" not in name:
                out.append((f"{i}.{name}", m))
    return out


def fp8_problem(linear: nn.Linear) -> str | None:
    n, k = linear.weight.shape
    if n % ALIGN or k % ALIGN:
        return f"shape {n}x{k} is not a multiple of {ALIGN}"
    if linear.weight.requires_grad:
        return "its weight is trained (fp8 here is for frozen weights)"
    return None


def _route(linear: nn.Linear, fn: Fp8Forward) -> None:
    wrapper = wrapper_of(linear)
    if wrapper is not None and hasattr(wrapper, "org_forward"):  # LoRA applied: only its frozen path changes
        setattr(linear, ATTR, ("lora", wrapper, wrapper.org_forward))
        wrapper.org_forward = fn
    else:
        setattr(linear, ATTR, ("module", None, linear.__dict__.get("forward")))
        linear.forward = fn


def install(
    blocks: list[nn.Module],
    *,
    quantize: bool,
    device: torch.device | None = None,
    keep_transposed: bool = False,
    stay: bool = False,
) -> tuple[int, int, str]:
    """Route every eligible block Linear through fp8. fp8 weights are used as stored; high-precision ones are
    quantised (on `device` when given, then put back where the weight lives) only with `quantize`.
    `keep_transposed`: each fp8 weight's transpose is made once here and kept (a buffer of its Linear, +1 byte
    per weight) instead of being made again by every input gradient (FLUX at 1024² on an H200: 228 transposes,
    5.3 ms of a 0.32 s step, for ~8 GiB). `stay`: what is made on `device` stays there instead of going back where
    the weight lives, for a model that moves to `device` next anyway (FLUX at fp8 on the H200 machine: the copies
    back to the host took 12 s of the start). Returns (installed, skipped, a note on the weights)."""
    done = skipped = quantized = kept = 0
    for _, lin in block_linears(blocks):
        if hasattr(lin, ATTR) or fp8_problem(lin):
            skipped += 1
            continue
        w = lin.weight.detach()
        home = device if stay and device is not None else w.device
        if w.dtype != E4M3:
            if not quantize:
                skipped += 1
                continue
            w, scale = quantize_weight(w.to(device or home))  # w stays on `device` for the transpose below
            lin.weight = nn.Parameter(w.to(home), requires_grad=False)
            lin.register_buffer(SCALE, scale.to(home), persistent=False)
            quantized += 1
        if keep_transposed:
            lin.register_buffer(TRANSPOSED, transpose(w.to(device or home)).to(home), persistent=False)
            kept += w.numel()
        _route(lin, Fp8Forward(lin))
        done += 1
    note = f"{quantized} weights quantised to e4m3 (one scale per row)" if quantized else "fp8 weights as stored"
    if keep_transposed:
        note += f"; their transposes kept for the input gradient, {kept / 2**30:.2f} GiB"
    return done, skipped, note


def uninstall(model: nn.Module) -> int:
    """Give every routed Linear its previous forward back (quantised weights stay fp8, their scales with them)."""
    undone = 0
    for m in model.modules():
        state = m.__dict__.pop(ATTR, None)
        if state is None:
            continue
        kind, wrapper, previous = state
        m._buffers.pop(TRANSPOSED, None)
        if kind == "lora":
            wrapper.org_forward = previous
        elif previous is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = previous
        undone += 1
    return undone


def has_fp8_weights(blocks: list[nn.Module]) -> bool:
    return any(lin.weight.dtype == E4M3 for _, lin in block_linears(blocks))
