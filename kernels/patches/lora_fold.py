"""A LoRA factor folded into the frozen matmul (`lora_fold`), on the layers where that pays.

sd-scripts' LoRA on a Linear (networks/lora_flux.py, LoRAModule.forward) computes

    y = x Wᵀ + bias + s · (x Aᵀ) Bᵀ              A = lora_down [r, K], B = lora_up [N, r], s = multiplier · scale

as the frozen GEMM plus an up-projection that writes an output-sized tensor to be added, and in the backward two
more GEMMs over the output-sized gradient dY (dY @ B and dYᵀ @ h) besides the frozen one. Folded:

    y             = [x, s·x·Aᵀ] @ [W, B]ᵀ + bias      one GEMM over K + r
    [dx₀, dY @ B] = dY @ [W, B]                       the input gradient's GEMM also gives the LoRA's dh
    dx = dx₀ + s·(dY @ B) @ A,  dA = (s·dY @ B)ᵀ x,  dB = dYᵀ (s·x·Aᵀ)

with W and B side by side in one buffer [N, K + r]: the frozen weight is re-homed into it at the model's first
forward on its device (the Linear's `weight` then a view of it), and B is copied in before every forward of the
model (`sync`, one multi-tensor copy; the optimizer changes B between forwards, never during one).

That pays only where the output is much wider than the input: the concatenated input is a copy of x and the input
gradient takes a pass of its own. On the H200 (scripts/bench_kernels.py --lora, compiled, forward + backward, GPU
ms): FLUX's single-block linear1 (4608 tokens, 3072 -> 21504) 2.013 against 2.258 for sd-scripts' form, while
linear2 (15360 -> 3072) went from 1.381 to 1.733 and the double blocks' layers were within +-3%. So B is folded only
where out_features >= WIDE * in_features: linear1 at first, and since the fold's input gradient lost its copy
(`input_grad`) the double blocks' MLP up-projection too (3072 -> 12288, 4x): whole vram80 runs 0.3259 / 0.3253
against 0.3284 / 0.3267 s/step (H200, alternating, same peaks).

Where the input is much wider than the output (linear2, the MLPs' second layer), the mirror fold (`FoldedDown`)
stacks A below W instead, [W; A] in one [N + r, K] buffer (with zero rows below A up to a multiple of `DOWN_ROWS`):

    [x Wᵀ, h] = x @ [W; A]ᵀ,  y = x Wᵀ + s·h Bᵀ + bias    h = x Aᵀ comes out of the frozen GEMM (one read of x)
    dx = [dY, s·dY @ B] @ [W; A]                         one GEMM over N + r; the concatenation copies the narrow dY
    dA = (s·dY @ B)ᵀ x,  dB = s·dYᵀ h

where sd-scripts' form reads the wide x once more in the forward and, in the backward, writes two input-wide
products and adds them. A is copied into its rows before every forward, as B is.

Nothing here imports sd-scripts: a LoRA module is recognised as flux_kernels.patches.lora_norms does, and only the plain
kind is folded (2-D factors, no dropout of any kind, no GGPO perturbation).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_kernels.patches import lora_norms

ATTR = "_flux_lora_fold"  # on a folded LoRA module: its _Fold; on the model: (hook handle, [_Fold])
BUFFER = "_flux_lora_fold_wb"  # on a folded Linear: the [N, K + r] or [N + r, K] buffer, once re-homed
DOWN = "_flux_lora_fold_down"  # on a mirror-folded Linear: True (its input gradient is one GEMM, not a sum of two)
WIDE = 4  # fold B where out_features >= WIDE * in_features (FLUX: linear1, 3072 -> 21504; mlp.0, 3072 -> 12288)
WIDE_IN = 4  # fold A where in_features >= WIDE_IN * out_features (FLUX: linear2, 15360 -> 3072; mlp.2, 12288 -> 3072)
FOLDABLE = f"out >= {WIDE}x in or in >= {WIDE_IN}x out"  # the layers folded, as messages name them
COMPACT = True  # the first re-homing on a CUDA device lays the model's frozen weights out anew (`compact`)
COMPACT_MIN = 2**20  # bytes: smaller tensors live in the allocator's small pool, apart from the weights
COMPACT_CHUNK = 256 * 2**20  # bytes copied before the old storage is released: the layout's transient
# the mirror fold's [W; A] buffer gets zero rows up to a multiple of this: its GEMM's output [x Wᵀ, x Aᵀ] is then N + r
# rounded up wide, a width inductor does not pad (it pads 3088 to 3136 for alignment), so a checkpointed block that
# keeps it for backward keeps a dense tensor, which activation_offload can take to the host (a padded one it leaves
# on the card: 27 MiB a single block at 1024²)
DOWN_ROWS = 64


def input_grad(dy: Tensor, wb: Tensor, a: Tensor, s: float) -> tuple[Tensor, Tensor]:
    """FoldedLoRA's input gradient and the LoRA's dh: [dx₀, dY @ B] = dY @ wb in one GEMM, dh = s·(dY @ B), then
    dx = dx₀ + dh @ A added in place into that product's first K columns. dx is returned as that view (row stride
    K + r): `torch.addmm` with the strided dx₀ as its input copied it into a fresh output first (a pass over dx,
    36 us a single block on the H200, 38 a step)."""
    k = a.shape[1]
    dxh = dy @ wb
    dh = dxh[:, k:] * s
    dx = dxh[:, :k]
    dx.addmm_(dh, a.to(dx.dtype))  # in-place ops are not autocast: A cast as autocast's addmm would (a no-op else)
    return dx, dh


@torch.library.custom_op("flux_kernels::lora_fold_input_grad", mutates_args=())
def _input_grad_op(dy: Tensor, wb: Tensor, a: Tensor, s: float) -> tuple[Tensor, Tensor]:
    """`input_grad` as one op for traced code: inductor would functionalize the in-place add on a view of the GEMM's
    output back into an out-of-place addmm (with its copy) and a scatter."""
    return input_grad(dy, wb, a, s)


@_input_grad_op.register_fake
def _(dy: Tensor, wb: Tensor, a: Tensor, s: float) -> tuple[Tensor, Tensor]:
    k = a.shape[1]
    return dy.new_empty((dy.shape[0], wb.shape[1]))[:, :k], dy.new_empty((dy.shape[0], wb.shape[1] - k))


class FoldedLoRA(torch.autograd.Function):
    """y = [x, s·x·Aᵀ] @ wbᵀ + bias for 2-D x; wb = [W, B] (B's columns already copied in). Gradients for x, A and
    B (the B passed in is only where its gradient goes: its values are read from wb)."""

    @staticmethod
    def forward(ctx, x: Tensor, wb: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
        k = a.shape[1]
        xh = torch.cat([x, (x @ a.t()) * s], dim=-1)
        ctx.save_for_backward(xh, wb, a)
        ctx.k, ctx.s = k, s
        return torch.addmm(bias, xh, wb.t()) if bias is not None else xh @ wb.t()

    @staticmethod
    def backward(ctx, dy: Tensor):
        xh, wb, a = ctx.saved_tensors
        k, s = ctx.k, ctx.s
        dx, dh = (_input_grad_op if torch.compiler.is_compiling() else input_grad)(dy, wb, a, s)
        return dx, None, None, dh.t() @ xh[:, :k], dy.t() @ xh[:, k:], None


class FoldedDown(torch.autograd.Function):
    """The mirror fold, for layers whose input is much wider than their output: y = x @ waᵀ gives [x Wᵀ, x Aᵀ] in
    one GEMM over N + r output columns (wa = [W; A], A's rows already copied in), then y = x Wᵀ + s·h Bᵀ + bias
    over the narrow output. Backward: dx = [dY, s·dY @ B] @ wa, one GEMM over N + r (the concatenated
    gradient is a copy of the narrow dY, where sd-scripts' form adds two input-wide products); dA = (s·dY @ B)ᵀ x,
    dB = s·dYᵀ h. Gradients for x, A and B (the A passed in is only where its gradient goes)."""

    @staticmethod
    def forward(ctx, x: Tensor, wa: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
        n, r = b.shape
        yh = x @ wa.t()  # [x Wᵀ, x Aᵀ] (and zeros, where wa has rows of zeros below A: DOWN_ROWS)
        h = yh[:, n : n + r].contiguous()
        ctx.save_for_backward(x, h, wa, b)
        ctx.s = s
        # not addmm: with the strided x Wᵀ as its input, it copies that into its output first; a pointwise sum is
        # one pass, which inductor fuses into whatever takes y
        y = yh[:, :n] + (h @ b.t()) * s
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, h, wa, b = ctx.saved_tensors
        s, (n, r) = ctx.s, b.shape
        dh = (dy @ b) * s
        dx = torch.cat([dy, dh], dim=-1) @ wa[: n + r]  # not the zero rows
        return dx, None, None, dh.t() @ x, (dy.t() @ h) * s, None


def folded_down_linear(x: Tensor, wa: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """The mirror-folded LoRA Linear for x [..., K]; every tensor in one dtype."""
    y = FoldedDown.apply(x.reshape(-1, x.shape[-1]), wa, bias, a, b, s)
    return y.view(*x.shape[:-1], b.shape[0])


def folded_linear(x: Tensor, wb: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """The folded LoRA Linear for x [..., K]; every tensor in one dtype (see _fold_forward for autocast)."""
    y = FoldedLoRA.apply(x.reshape(-1, x.shape[-1]), wb, bias, a, b, s)
    return y.view(*x.shape[:-1], wb.shape[0])


def reference_linear(x: Tensor, w: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """sd-scripts' LoRA on a Linear: the frozen layer plus up(down(x)) * s."""
    return F.linear(x, w, bias) + F.linear(F.linear(x, a), b) * s


def fast_linear(x: Tensor, w: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """`folded_linear` with the [W, B] buffer built from w and b."""
    return folded_linear(x, torch.cat([w, b.detach()], dim=1), bias, a, b, s)


def fast_down_linear(x: Tensor, w: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """`folded_down_linear` with the [W; A] buffer built from w and a."""
    return folded_down_linear(x, torch.cat([w, a.detach()], dim=0), bias, a, b, s)


def reference_mlp(x: Tensor, *layers) -> Tensor:
    """Two LoRA'd Linears as sd-scripts has them, widening then narrowing (x -> GELU -> y), each given as
    (w, bias, a, b, s): the registry probe's reference, one layer for each fold."""
    (w1, b1, a1, u1, s1), (w2, b2, a2, u2, s2) = _pairs(layers)
    return reference_linear(F.gelu(reference_linear(x, w1, b1, a1, u1, s1)), w2, b2, a2, u2, s2)


def fast_mlp(x: Tensor, *layers) -> Tensor:
    """`reference_mlp` with the widening layer's B folded and the narrowing layer's A folded."""
    (w1, b1, a1, u1, s1), (w2, b2, a2, u2, s2) = _pairs(layers)
    return fast_down_linear(F.gelu(fast_linear(x, w1, b1, a1, u1, s1)), w2, b2, a2, u2, s2)


def _pairs(layers: tuple) -> tuple[tuple, tuple]:
    return layers[:5], layers[5:]


# ---- installing into a model ------------------------------------------------------------------------------------


def side(linear: nn.Linear) -> str | None:
    """Which factor folds into this Linear's GEMM: "up" (B beside W: much wider output), "down" (A below W: much
    wider input) or None."""
    if linear.out_features >= WIDE * linear.in_features:
        return "up"
    if linear.in_features >= WIDE_IN * linear.out_features:
        return "down"
    return None


class _Fold:
    """One folded layer: the Linear, its LoRA module, the forward it had before (sd-scripts' LoRA forward) and which
    factor shares the frozen weight's buffer."""

    def __init__(self, linear: nn.Linear, lora: nn.Module, previous) -> None:
        self.linear, self.lora, self.previous = linear, lora, previous
        self.side = side(linear)
        self.factor = lora.lora_up if self.side == "up" else lora.lora_down
        self.slot: Tensor | None = None  # wb[:, K:] or wa[N:N + r], where the factor's values go (once re-homed)

    def rehome(self) -> None:
        """Move the frozen weight into a buffer beside B ([N, K + r]) or above A ([N + r, K], zero rows below A up to
        a multiple of DOWN_ROWS); the Linear's weight becomes a view of it."""
        lin = self.linear
        w = lin.weight
        n, k = w.shape
        r = self.factor.weight.shape[1 if self.side == "up" else 0]
        shape = (n, k + r) if self.side == "up" else (-(-(n + r) // DOWN_ROWS) * DOWN_ROWS, k)
        buf = torch.empty(shape, dtype=w.dtype, device=w.device)
        view = buf[:, :k] if self.side == "up" else buf[:n]
        view.copy_(w.detach())
        if self.side != "up":
            buf[n + r :].zero_()
        lin.register_buffer(BUFFER, buf, persistent=False)
        lin.weight = nn.Parameter(view, requires_grad=False)
        self.slot = buf[:, k:] if self.side == "up" else buf[n : n + r]


def _fold_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward of a folded Linear, bound to its LoRA module (so lora_norms and others still find the LoRA).
    Under autocast the factors are cast to the frozen weight's dtype, as autocast would cast them for F.linear."""
    fold: _Fold = self.__dict__[ATTR]
    buf = getattr(fold.linear, BUFFER, None)
    if buf is None or buf.device != x.device:
        return fold.previous(x)  # not re-homed yet (the model's first forward does it), or the weight moved
    dtype = buf.dtype
    bias = fold.linear.bias
    a, b = self.lora_down.weight.to(dtype), self.lora_up.weight.to(dtype)
    s = float(self.multiplier) * float(self.scale)
    fn = folded_linear if fold.side == "up" else folded_down_linear
    return fn(x.to(dtype), buf, None if bias is None else bias.to(dtype), a, b, s)


def _problem(linear: nn.Module, lora: nn.Module) -> str | None:
    """Why this LoRA'd layer is not folded (None: it is)."""
    if not isinstance(linear, nn.Linear):
        return "not a Linear"
    if not all(isinstance(getattr(lora, f, None), nn.Linear) for f in ("lora_down", "lora_up")):
        return "split or conv LoRA"
    if any(getattr(lora, f, None) is not None for f in ("dropout", "rank_dropout", "module_dropout")):
        return "LoRA dropout"
    if getattr(lora, "ggpo_sigma", None) is not None and getattr(lora, "ggpo_beta", None) is not None:
        return "GGPO"
    if linear.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or linear.weight.requires_grad:
        return "weight not a frozen float weight (fp8 layers go through fp8_matmul)"
    if getattr(lora.org_forward, "__self__", None) is not linear:
        return "the frozen forward is patched already"
    if side(linear) is None:
        return f"neither output >= {WIDE}x the input nor input >= {WIDE_IN}x the output (folding measured slower there)"
    return None


def candidates(model: nn.Module) -> list[tuple[nn.Linear, nn.Module]]:
    """(Linear, LoRA module) pairs that qualify, in module order. Not the modulation layers (`...mod.lin`, 3072 ->
    18432 in FLUX's double blocks): their input is one row per image, where a fold has nothing to save."""
    out = []
    for name, m in model.named_modules():
        if "mod" in ".".join(name.split(".")[-2:]):  # img_mod.lin, txt_mod.lin, modulation.lin
            continue
        lora = lora_norms.wrapper_of(m)
        if lora is None or lora is m or not hasattr(lora, "org_forward") or ATTR in lora.__dict__:
            continue
        if _problem(m, lora) is None:
            out.append((m, lora))
    return out


def compact(model: nn.Module, folds: list[_Fold]) -> int:
    """Re-home `folds` while laying every frozen weight of `model` of at least `COMPACT_MIN` bytes out anew, in
    address order, `COMPACT_CHUNK` bytes at a time, each chunk's old storage released before the next (CUDA:
    `empty_cache`). Returns how many weights were copied besides the folded ones.

    Why: a buffer is K + r wide, so it fits no hole a folded weight leaves, and the holes lie between weights that
    stay (the blocks' attention and modulation layers). Re-homed one by one, the folded weights' old pages stayed
    mapped in part around every hole: with expandable segments (flux-train's allocator setting) the allocator
    unmaps whole 20 MiB pages only. On the H200 (`vram48`, every block checkpointed, offload) that held 1.36 GiB free
    in 55 mapped ranges, against 0.40 GiB in one without the fold. Moving the weights that stay as well slides the
    whole model down into the space each chunk leaves: the copies are the same values in new storage (a frozen
    parameter keeps its object, `.data` is swapped), once, before anything has been compiled or recorded."""
    by_weight = {id(f.linear.weight): f for f in folds}
    # the queue holds the only references this function keeps: a re-homed weight's old Parameter must die at its
    # turn, or every later chunk is laid out while all the old weights are alive (H200: +10.9 GiB at the first step)
    queue = sorted(
        (p for p in model.parameters() if not p.requires_grad and (id(p) in by_weight or p.nbytes >= COMPACT_MIN)),
        key=lambda p: (str(p.device), p.data_ptr()),
        reverse=True,
    )
    cuda = any(p.is_cuda for p in queue)
    copied, chunk = 0, 0
    while queue:
        p = queue.pop()
        fold = by_weight.pop(id(p), None)
        chunk += p.nbytes
        if fold is not None:
            del p
            fold.rehome()
        else:
            with torch.no_grad():
                fresh = torch.empty_like(p, memory_format=torch.contiguous_format)
                fresh.copy_(p)
            p.data = fresh
            del p, fresh
            copied += 1
        if chunk >= COMPACT_CHUNK and cuda:
            chunk = 0
            torch.cuda.empty_cache()
    if cuda:
        torch.cuda.empty_cache()
    return copied


def sync(folds: list[_Fold], model: nn.Module | None = None) -> None:
    """Re-home what is not yet (weights now on their training device), then copy every B into its buffer. The first
    re-homing on a CUDA device lays the model's frozen weights out anew with it (`compact`)."""
    moved = [f for f in folds if f.slot is None or f.slot.device != f.linear.weight.device]
    first = all(f.slot is None for f in folds)  # then every fold is in `moved`
    if moved and first and model is not None and COMPACT and all(f.linear.weight.is_cuda for f in moved):
        compact(model, moved)
    else:
        for f in moved:
            f.rehome()
        if any(f.slot.is_cuda for f in moved):
            torch.cuda.empty_cache()  # the old weights' blocks (a buffer is K + r wide: they do not fit it), once
    with torch.no_grad():
        torch._foreach_copy_([f.slot for f in folds], [f.factor.weight for f in folds])


def install(model: nn.Module) -> int:
    """Fold every qualifying LoRA'd Linear of `model`; the model's forward pre-hook re-homes the weights at the first
    forward and syncs the folded factors before every forward. Returns how many layers."""
    pairs = candidates(model)
    if not pairs:
        return 0
    folds = []
    for linear, lora in pairs:
        fold = _Fold(linear, lora, linear.__dict__["forward"])
        lora.__dict__[ATTR] = fold
        linear.forward = types.MethodType(_fold_forward, lora)
        if fold.side == "down":
            linear.__dict__[DOWN] = True
        folds.append(fold)
    previous = model.__dict__.get(ATTR)
    if previous is not None:
        previous[0].remove()
        folds = previous[1] + folds
    handle = model.register_forward_pre_hook(lambda m, _args: sync(folds, m))
    model.__dict__[ATTR] = (handle, folds)
    return len(pairs)


def sides(model: nn.Module) -> dict[str, int]:
    """How many folded layers of `model` hold B ("up") and A ("down") beside their frozen weight."""
    state = model.__dict__.get(ATTR)
    folds = state[1] if state else []
    return {k: sum(f.side == k for f in folds) for k in ("up", "down")}


def folded_down(linear: nn.Module) -> bool:
    """Whether this Linear's LoRA is mirror-folded (A below W), so that its input gradient comes out of one GEMM."""
    return getattr(linear, DOWN, False) is True


def uninstall(model: nn.Module) -> int:
    """Give each folded Linear its previous forward back (a re-homed weight stays a view of its buffer: same values)."""
    state = model.__dict__.pop(ATTR, None)
    if state is None:
        return 0
    handle, folds = state
    handle.remove()
    for f in folds:
        f.linear.forward = f.previous
        f.linear.__dict__.pop(DOWN, None)
        f.lora.__dict__.pop(ATTR, None)
    return len(folds)
