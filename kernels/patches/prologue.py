"""FLUX's per-step embeddings, made without the host work the GPU waits on (`flux_prologue`).

Before its first block, sd-scripts' `Flux.forward` builds on every step

  * two sinusoidal embeddings (`timestep_embedding`: the timesteps and the guidance scale). Each builds its
    frequency table on the host and copies it to the GPU from pageable memory, a copy that first waits for the
    device to drain: two syncs a step, at the start of the forward, where nothing is queued to hide them;
  * the RoPE table (`EmbedND`): for each of the 3 position axes, a dozen float64 ops and a stack, then a cat.
    That is about 40 small kernels a step, all launched from Python with the GPU idle, for one table.

Installed, the frequency table is built once per (dim, max_period, device) by the same host computation and kept
on the device, and the RoPE table from the angles of all axes side by side through one cos, one sin, one stack
(~9 kernels instead of ~40). Both give the same bits as sd-scripts' code: the same float32 / float64 operations,
element for element. Each axis's angles come from the same einsum of the same operands as sd-scripts', so autocast
treats them alike: a first version that multiplied the positions in float64 itself differed from sd-scripts' under
CUDA autocast (H200) for fractional positions, which that einsum takes rounded to bf16 there. Tests check the
equality against sd-scripts' own functions, on the CPU and, with and without autocast, on a GPU.

The trainer's side (flux_trainer.sdscripts.hooks, with this kernel installed): the image position ids, which
sd-scripts builds on the host and copies from pageable memory every step (`prepare_img_ids(...).to(device)`, one
more sync), come from `kept_on`: built by sd-scripts' own function once per shape, kept on the device, a copy
handed out each step.

Nothing here imports sd-scripts: the model's `pe_embedder` is recognised by what it has (`theta`, `axes_dim`), and
its `timestep_embedding` is the function of that name in the model's own module.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn

ATTR = "_flux_prologue"  # on the model: the module-level timestep_embedding it replaced (None where none)


def reference_timestep_embedding(t: Tensor, dim: int, max_period: int = 10000, time_factor: float = 1000.0):
    """The plain computation: sinusoidal embedding [N, dim] of N (fractional) timesteps, cos half then sin half."""
    return _embed(time_factor * t, _host_freqs(dim // 2, max_period).to(t.device), dim)


def _host_freqs(half: int, max_period: int) -> Tensor:
    """exp(-ln(max_period) * i / half) for i < half, float32, computed on the host (as FLUX's code does)."""
    return torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)


def _embed(t: Tensor, freqs: Tensor, dim: int) -> Tensor:
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding.to(t) if torch.is_floating_point(t) else embedding


_FREQS: dict[tuple[int, int, torch.device], Tensor] = {}


def timestep_embedding(t: Tensor, dim: int, max_period: int = 10000, time_factor: float = 1000.0) -> Tensor:
    """reference_timestep_embedding with the frequency table kept on t's device after its first use."""
    key = (dim // 2, max_period, t.device)
    freqs = _FREQS.get(key)
    if freqs is None:
        freqs = _FREQS[key] = _host_freqs(dim // 2, max_period).to(t.device)
    return _embed(time_factor * t, freqs, dim)


def _omega(dim: int, theta: float, device) -> Tensor:
    """RoPE's frequencies of one axis: theta^(-2i/dim), float64."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))


def _rotations(angles: Tensor) -> Tensor:
    """[..., d] angles -> [..., d, 2, 2] rotation matrices (cos, -sin; sin, cos), float32."""
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2)).float()


def reference_rope_table(ids: Tensor, axes_dim: list[int], theta: float) -> Tensor:
    """The plain computation: ids [B, L, n_axes] -> [B, 1, L, sum(axes_dim) / 2, 2, 2], axis by axis: each axis's
    positions times its frequencies as an einsum of the float32 positions with the float64 frequencies. (Under
    CUDA autocast that einsum takes the positions in bf16, exact for the integer positions FLUX trains on, up to
    256; a plain float64 product would not, for fractional positions.)"""
    per_axis = [
        _rotations(torch.einsum("...n,d->...nd", ids[..., i], _omega(d, theta, ids.device)))
        for i, d in enumerate(axes_dim)
    ]
    return torch.cat(per_axis, dim=-3).unsqueeze(1)


_OMEGAS: dict[tuple[tuple[int, ...], float, torch.device], list[Tensor]] = {}


def rope_table(ids: Tensor, axes_dim: list[int], theta: float) -> Tensor:
    """reference_rope_table with each axis's frequencies kept on the device, and the angles of all axes, side by
    side, through one cos, one sin and one stack: each angle from the same einsum of the same operands as the
    per-axis computation (so autocast treats it the same way)."""
    key = (tuple(axes_dim), theta, ids.device)
    if key not in _OMEGAS:
        _OMEGAS[key] = [_omega(d, theta, ids.device) for d in axes_dim]
    angles = [torch.einsum("...n,d->...nd", ids[..., i], omega) for i, omega in enumerate(_OMEGAS[key])]
    return _rotations(torch.cat(angles, dim=-1)).unsqueeze(1)


def reference_prologue(t: Tensor, ids: Tensor, axes_dim=(4, 6, 6), theta=10000) -> tuple[Tensor, Tensor]:
    return reference_timestep_embedding(t, 256), reference_rope_table(ids, list(axes_dim), theta)


def fast_prologue(t: Tensor, ids: Tensor, axes_dim=(4, 6, 6), theta=10000) -> tuple[Tensor, Tensor]:
    return timestep_embedding(t, 256), rope_table(ids, list(axes_dim), theta)


def kept_on(device, build: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`build(*key)`'s result moved to `device` once per key and kept; each call returns a copy made on the device
    (a caller may mark it as needing grad, as sd-scripts does with gradient checkpointing, without touching the
    kept one)."""
    kept: dict[tuple, Tensor] = {}

    def call(*key):
        if key not in kept:
            kept[key] = build(*key).to(device)
        return kept[key].clone()

    return call


def _pe_embedder(model: nn.Module) -> nn.Module:
    pe = getattr(model, "pe_embedder", None)
    if not (isinstance(pe, nn.Module) and hasattr(pe, "theta") and hasattr(pe, "axes_dim")):
        raise ValueError("flux_prologue: the model has no pe_embedder with theta / axes_dim (not a FLUX model)")
    return pe


def install(model: nn.Module) -> str:
    """The model's RoPE table through one cos / sin / stack, and the module-level timestep_embedding its forward
    calls (where there is one) with its frequency table kept on the device. Undone by `uninstall`."""
    pe = _pe_embedder(model)
    axes_dim, theta = list(pe.axes_dim), pe.theta
    pe.forward = lambda ids: rope_table(ids, axes_dim, theta)
    home = sys.modules.get(type(model).__module__)
    replaced = getattr(home, "timestep_embedding", None)
    if callable(replaced) and replaced is not timestep_embedding:
        home.timestep_embedding = timestep_embedding
    else:
        replaced = None
    setattr(model, ATTR, replaced)
    what = "the RoPE table in one cos/sin pass" + (", timestep frequencies kept on the device" if replaced else "")
    return f"flux_prologue: {what}"


def uninstall(model: nn.Module) -> bool:
    if not hasattr(model, ATTR):
        return False
    replaced = model.__dict__.pop(ATTR)
    _pe_embedder(model).__dict__.pop("forward", None)
    home = sys.modules.get(type(model).__module__)
    if replaced is not None and getattr(home, "timestep_embedding", None) is timestep_embedding:
        home.timestep_embedding = replaced
    return True
