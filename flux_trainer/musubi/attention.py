"""flux_kernels' attention backend choice (`AttentionDispatch`) inside musubi-tuner's FLUX.2 and Kontext blocks.

musubi-tuner's blocks call a module-level function for their attention, looked up in their module's globals at every
call: `musubi_tuner.flux.flux_models.attention(q, k, v, pe, attn_mask, attn_mode, split_attn, control_lengths)`
(Kontext) and `musubi_tuner.flux_2.flux2_models.attention(qkv_list, pe, attn_params)` (FLUX.2), both taking q, k, v as
[B, H, L, D] before RoPE and giving tokens [B, L, H*D]. `install` puts ours in that global. Where a call is plain
self-attention (no mask, no per-sample split or trim, as many key heads as query heads) it applies musubi-tuner's own
`apply_rope` (the checkout's function, imported with its module) and returns `dispatch.tokens(q, k, v)`: the backend
the probe chose at the run's shape, as sd-scripts' patched FLUX.1 blocks call it. Every other call goes to
musubi-tuner's function as it was (Kontext's split attention and unequal reference lengths, FLUX.2's masks, split and
variable lengths). musubi-tuner's `attn_mode` (`kernels.attention`: `sdpa` / `xformers` in its TOML) then serves only
those calls, `kernels=off` and the bench's plain baseline; nothing of this goes through the TOML.

Verified before installed (`verify`): ours against musubi-tuner's function on random inputs at a few tokens and the
model's heads, forward and backward (output, dq, dk, dv), in the run's dtype on the training device; the reference runs
without cuDNN (`without_cudnn`: cuDNN's backward cache does not key the incoming gradient's layout, and the two
functions hand it different ones at one shape). The backend compiled blocks use is decided once, at the transformer's
first training forward (a forward pre-hook, before any block is traced): `AttentionDispatch.decide_run`, with every
rank taking rank 0's verdict.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger("flux_trainer.musubi.runner")
ATTR = "_flux_train_attention"  # on the transformer: what `install` did (Installed)
ORIGINAL = "_flux_train_original"  # on our function: musubi-tuner's, which it replaced
TOKENS = 19  # `verify`'s sequence: a few tokens, a length no training shape has
KINDS = {"flux_models": "kontext", "flux2_models": "flux2"}


@dataclass
class Installed:
    dispatch: Any  # flux_kernels.patches.attention.dispatch.AttentionDispatch
    module: ModuleType  # musubi-tuner's model module whose `attention` global is ours
    hook: Any  # the transformer's forward pre-hook handle (decide_run)


def kind(model: nn.Module) -> str | None:
    """`kontext` or `flux2` for musubi-tuner's transformers, None for anything else."""
    return KINDS.get(type(model).__module__.rsplit(".", 1)[-1])


def _same(lengths: list[int] | None) -> bool:
    """Kontext's reference lengths leave the sequence whole (musubi-tuner trims per sample where they differ)."""
    return not lengths or min(lengths) == max(lengths)


def plain_params(attn_params: Any) -> bool:
    """FLUX.2's AttentionParams ask for plain self-attention: no mask, no split, no variable lengths."""
    if attn_params is None:
        return True
    return not attn_params.split_attn and all(
        getattr(attn_params, name) is None for name in ("attention_mask", "seqlens", "cu_seqlens")
    )


def kontext_attention(dispatch: Any, original: Callable, apply_rope: Callable) -> Callable:
    """Kontext's `attention` with the dispatch in its plain calls (the others: `original`)."""

    def attention(q, k, v, pe, attn_mask=None, attn_mode="torch", split_attn=False, control_lengths=None):
        if attn_mask is None and not split_attn and _same(control_lengths) and q.shape[1] == k.shape[1]:
            q, k = apply_rope(q, k, pe)
            return dispatch.tokens(q, k, v)
        return original(q, k, v, pe, attn_mask=attn_mask, attn_mode=attn_mode, split_attn=split_attn,
                        control_lengths=control_lengths)  # fmt: skip

    setattr(attention, ORIGINAL, original)
    return attention


def flux2_attention(dispatch: Any, original: Callable, apply_rope: Callable) -> Callable:
    """FLUX.2's `attention` with the dispatch in its plain calls (the others: `original`)."""

    def attention(qkv_list, pe, attn_params):
        if plain_params(attn_params) and qkv_list[0].shape[1] == qkv_list[1].shape[1]:
            q, k, v = qkv_list
            qkv_list.clear()  # as musubi-tuner's does: the block's list keeps no q, k, v alive past this call
            q, k = apply_rope(q, k, pe)
            return dispatch.tokens(q, k, v)
        return original(qkv_list, pe, attn_params)

    setattr(attention, ORIGINAL, original)
    return attention


def _module_of(model: nn.Module) -> ModuleType:
    return sys.modules[type(model).__module__]


def replacement(model: nn.Module, dispatch: Any) -> tuple[ModuleType, Callable, Callable]:
    """(musubi-tuner's module, its own attention function, ours) for `model`'s kind."""
    module = _module_of(model)
    original = getattr(module.attention, ORIGINAL, module.attention)
    make = kontext_attention if kind(model) == "kontext" else flux2_attention
    return module, original, make(dispatch, original, module.apply_rope)


def refusal(model: nn.Module) -> str | None:
    """Why our attention does not go into `model` at all, or None."""
    if kind(model) is None:
        return f"{type(model).__name__} is not musubi-tuner's FLUX.2 or Kontext transformer"
    module = _module_of(model)
    if not callable(getattr(module, "attention", None)) or not callable(getattr(module, "apply_rope", None)):
        return f"{module.__name__} has no attention() / apply_rope() (another musubi-tuner than the pinned one?)"
    if getattr(model, "split_attn", False):
        return "split_attn is set: musubi-tuner runs its attention per sample there, which the dispatch does not take"
    return None


def _caller(model: nn.Module, fn: Callable, pe: Tensor) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """fn (musubi-tuner's attention or ours) called as the model's blocks call it."""
    mode = getattr(model, "attn_mode", "torch")
    if kind(model) == "kontext":
        return lambda q, k, v: fn(q, k, v, pe=pe, attn_mode=mode, split_attn=False, control_lengths=None)
    params = _module_of(model).AttentionParams.create_attention_params(mode, False)
    return lambda q, k, v: fn([q, k, v], pe, params)


def _fwd_bwd(run: Callable, inputs: list[Tensor], upstream: Tensor) -> list[Tensor]:
    """Output and q/k/v gradients in the inputs' dtype, whatever grad mode or autocast the caller is in."""
    with torch.enable_grad(), torch.autocast(upstream.device.type, enabled=False):
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        out = run(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), upstream)
    return [out.detach(), *grads]


def verify(model: nn.Module, ours: Callable, original: Callable, device: torch.device, dtype: torch.dtype):
    """Ours against musubi-tuner's attention at TOKENS tokens, 2 samples, the model's heads: output and q/k/v
    gradients within block_compile.TOLERANCE (max |ours - theirs| / max |theirs|). (ok, line)."""
    from flux_kernels.patches.attention.backends import without_cudnn
    from flux_trainer.musubi.block_compile import TOLERANCE, rope_table

    heads = int(model.num_heads)
    dim = int(model.hidden_size) // heads
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, TOKENS, dim, generator=gen).to(device, dtype) for _ in range(3))
    upstream = torch.randn(2, TOKENS, heads * dim, generator=gen).to(device, dtype)
    pe = rope_table(model, TOKENS, gen, device)
    plainly = without_cudnn() if device.type == "cuda" else contextlib.nullcontext()
    with plainly:
        want = _fwd_bwd(_caller(model, original, pe), [q, k, v], upstream)
    got = _fwd_bwd(_caller(model, ours, pe), [q, k, v], upstream)
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    name = str(dtype).removeprefix("torch.")
    worst = 0.0
    for what, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-12)).item()
        worst = max(worst, err) if err == err else float("nan")
        if not err <= tol:
            return False, f"{name} {what} differs from musubi-tuner's attention (max rel. error {err:.2e} > {tol:.0e})"
    return True, f"matches musubi-tuner's attention, fwd+bwd ({name}, max rel. error {worst:.1e})"


def install(model: nn.Module, dispatch: Any, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Verify ours against musubi-tuner's attention, then put it in the model module's `attention` global and hook
    the transformer's first training forward (the backend compiled blocks use). (ok, line); where not ok nothing is
    changed."""
    why = refusal(model)
    if why:
        return False, why
    module, original, ours = replacement(model, dispatch)
    rng = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng):  # the probes' draws are put back: kernels=auto draws what off draws
        ok, line = verify(model, ours, original, device, dtype)
    if not ok:
        return False, line
    remove(model)
    module.attention = ours
    hook = model.register_forward_pre_hook(functools.partial(_decide, dispatch, dtype), with_kwargs=True)
    model.__dict__[ATTR] = Installed(dispatch, module, hook)
    return True, line


def installed(model: nn.Module) -> Installed | None:
    return model.__dict__.get(ATTR)


def remove(model: nn.Module) -> bool:
    """Undo `install`: musubi-tuner's function back in its module, the hook gone. True when there was something."""
    done = model.__dict__.pop(ATTR, None)
    module = _module_of(model) if kind(model) else None
    original = getattr(getattr(module, "attention", None), ORIGINAL, None)
    if original is not None:
        module.attention = original
    if done is not None:
        done.hook.remove()
    return done is not None or original is not None


def attention_shape(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype):
    """((B, H, L, D), dtype, device) of the blocks' attention in a call of the transformer with `args` / `kwargs`,
    where that call's attention is plain (Kontext: its reference lengths equal); None otherwise. The dtype is
    autocast's where it is on here, else `dtype`, the run's: accelerate enters the mixed-precision autocast inside the
    model's forward, after its pre-hooks."""
    try:
        bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    img, txt = (bound.get("img"), bound.get("txt")) if kind(model) == "kontext" else (bound.get("x"), bound.get("ctx"))
    if not (isinstance(img, Tensor) and isinstance(txt, Tensor) and img.dim() == txt.dim() == 3):
        return None
    if kind(model) == "kontext" and not _same(bound.get("control_lengths")):
        return None
    heads = int(model.num_heads)
    device = img.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtype
    return (img.shape[0], heads, img.shape[1] + txt.shape[1], int(model.hidden_size) // heads), dtype, img.device


def _decide(dispatch: Any, dtype: torch.dtype, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on the transformer: at its first training call (grad enabled: a sample rendered before
    training is at another shape, and with several GPUs only some ranks render one, while deciding is a collective),
    before any compiled block is traced, the probe at the run's shape decides the backend compiled blocks use."""
    if dispatch.run_choice is not None or not torch.is_grad_enabled():
        return
    found = attention_shape(model, args, kwargs, dtype)
    if found is not None:
        dispatch.decide_run(*found, False)
        log.info("kernels: attention: %s", dispatch.run_line)
