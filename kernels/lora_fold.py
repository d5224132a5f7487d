"""The LoRA's up-projection folded into the frozen matmul (`lora_fold`), on the layers where that pays.

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

It pays only where the output is much wider than the input: the concatenated input is a copy of x and the input
gradient takes a pass of its own. On the H200 (scripts/bench_kernels.py --lora, compiled, forward + backward, GPU
ms): FLUX's single-block linear1 (4608 tokens, 3072 -> 21504) 2.013 against 2.258 for sd-scripts' form, while
linear2 (15360 -> 3072) went from 1.381 to 1.733 and the double blocks' layers were within +-3%. So a layer is
folded only where out_features >= WIDE * in_features.

Nothing here imports sd-scripts: a LoRA module is recognised as flux_kernels.lora_norms does, and only the plain
kind is folded (2-D factors, no dropout of any kind, no GGPO perturbation).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flux_kernels import lora_norms

ATTR = "_flux_lora_fold"  # on a folded LoRA module: its _Fold; on the model: (hook handle, [_Fold])
BUFFER = "_flux_lora_fold_wb"  # on a folded Linear: the [N, K + r] buffer, once re-homed
WIDE = 6  # fold where out_features >= WIDE * in_features (FLUX: the single blocks' linear1, 3072 -> 21504)


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
        dxh = dy @ wb  # [dx₀, dY @ B]
        dh = dxh[:, k:] * s
        dx = torch.addmm(dxh[:, :k], dh, a)
        return dx, None, None, dh.t() @ xh[:, :k], dy.t() @ xh[:, k:], None


def folded_linear(x: Tensor, wb: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """The folded LoRA Linear for x [..., K]; every tensor in one dtype (see _fold_forward for autocast)."""
    y = FoldedLoRA.apply(x.reshape(-1, x.shape[-1]), wb, bias, a, b, s)
    return y.view(*x.shape[:-1], wb.shape[0])


def reference_linear(x: Tensor, w: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """sd-scripts' LoRA on a Linear: the frozen layer plus up(down(x)) * s."""
    return F.linear(x, w, bias) + F.linear(F.linear(x, a), b) * s


def fast_linear(x: Tensor, w: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, s: float) -> Tensor:
    """`folded_linear` with the [W, B] buffer built from w and b: the registry probe's fast side."""
    return folded_linear(x, torch.cat([w, b.detach()], dim=1), bias, a, b, s)


# ---- installing into a model ------------------------------------------------------------------------------------


class _Fold:
    """One folded layer: the Linear, its LoRA module and the forward it had before (sd-scripts' LoRA forward)."""

    def __init__(self, linear: nn.Linear, lora: nn.Module, previous) -> None:
        self.linear, self.lora, self.previous = linear, lora, previous
        self.slot: Tensor | None = None  # wb[:, K:], where B's values go (once re-homed)

    def rehome(self) -> None:
        """Move the frozen weight into a [N, K + r] buffer beside B; the Linear's weight becomes a view of it."""
        lin, up = self.linear, self.lora.lora_up.weight
        w = lin.weight
        n, k = w.shape
        wb = torch.empty(n, k + up.shape[1], dtype=w.dtype, device=w.device)
        wb[:, :k].copy_(w.detach())
        lin.register_buffer(BUFFER, wb, persistent=False)
        lin.weight = nn.Parameter(wb[:, :k], requires_grad=False)
        self.slot = wb[:, k:]


def _fold_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The forward of a folded Linear, bound to its LoRA module (so lora_norms and others still find the LoRA).
    Under autocast the factors are cast to the frozen weight's dtype, as autocast would cast them for F.linear."""
    fold: _Fold = self.__dict__[ATTR]
    wb = getattr(fold.linear, BUFFER, None)
    if wb is None or wb.device != x.device:
        return fold.previous(x)  # not re-homed yet (the model's first forward does it), or the weight moved
    dtype = wb.dtype
    bias = fold.linear.bias
    a, b = self.lora_down.weight.to(dtype), self.lora_up.weight.to(dtype)
    s = float(self.multiplier) * float(self.scale)
    return folded_linear(x.to(dtype), wb, None if bias is None else bias.to(dtype), a, b, s)


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
    if linear.out_features < WIDE * linear.in_features:
        return f"output not >= {WIDE}x the input (folding measured slower there)"
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


def sync(folds: list[_Fold]) -> None:
    """Re-home what is not yet (weights now on their training device), then copy every B into its buffer."""
    moved = [f for f in folds if f.slot is None or f.slot.device != f.linear.weight.device]
    for f in moved:
        f.rehome()
    if any(f.slot.is_cuda for f in moved):
        torch.cuda.empty_cache()  # the old weights' blocks (a buffer is K + r wide: they do not fit it), once
    with torch.no_grad():
        torch._foreach_copy_([f.slot for f in folds], [f.lora.lora_up.weight for f in folds])


def install(model: nn.Module) -> int:
    """Fold every qualifying LoRA'd Linear of `model`; the model's forward pre-hook re-homes the weights at the first
    forward and syncs B before every forward. Returns how many layers."""
    pairs = candidates(model)
    if not pairs:
        return 0
    folds = []
    for linear, lora in pairs:
        fold = _Fold(linear, lora, linear.__dict__["forward"])
        lora.__dict__[ATTR] = fold
        linear.forward = types.MethodType(_fold_forward, lora)
        folds.append(fold)
    previous = model.__dict__.get(ATTR)
    if previous is not None:
        previous[0].remove()
        folds = previous[1] + folds
    handle = model.register_forward_pre_hook(lambda _m, _args: sync(folds))
    model.__dict__[ATTR] = (handle, folds)
    return len(pairs)


def uninstall(model: nn.Module) -> int:
    """Give each folded Linear its previous forward back (a re-homed weight stays a view of its buffer: same values)."""
    state = model.__dict__.pop(ATTR, None)
    if state is None:
        return 0
    handle, folds = state
    handle.remove()
    for f in folds:
        f.linear.forward = f.previous
        f.lora.__dict__.pop(ATTR, None)
    return len(folds)
