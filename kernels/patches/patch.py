"""Install kernels into an already-built sd-scripts FLUX model, reversibly, one switch per kernel.

Blocks are found by what they have, not by importing sd-scripts: a double-stream block has `img_mod`, `txt_mod`,
`img_attn`, `txt_attn`, `img_mlp`, `txt_mlp`; a single-stream block has `linear1`, `linear2`, `pre_norm`,
`modulation`, `norm`. On each, the instance attribute `_forward` shadows the class method. sd-scripts' own
`forward` still decides about gradient checkpointing (`checkpoint(self._forward, ...)` now finds ours), block
swapping and CPU offload stay untouched, and every Linear/Modulation/QKNorm submodule is still *called* as a
module, so LoRA (which replaces those modules' `forward`) works whether it is applied before or after this.

Why the patched forward equals sd-scripts': `_double_forward`/`_single_forward` below perform sd-scripts'
operations in sd-scripts' order; each fused step is swapped in only where its switch is on:
  * modulate: `(1 + scale) * norm(x) + shift` is exactly what the block writes; the kernel computes it in fp32
    with one final rounding instead of four (agrees to ~1 bf16 ulp).
  * qk_norm_rope: sd-scripts normalises each stream with its QKNorm, concatenates txt then img along L, and
    `attention()` applies RoPE over the whole sequence. RMSNorm is per row, so normalising each stream into its
    slice of the concatenated output and rotating each row by its own `pe` row is the same computation; the
    kernel even rounds the normalised value to the input dtype before rotating, as QKNorm's return does.
  * attention: `attention()` minus RoPE (done above): SDPA or another backend that the probe found to agree
    with the fp32 math reference, then "B H L D -> B L (H D)" as
    `flux_kernels.patches.attention.backends.heads_to_tokens`, which hands the backend's backward a contiguous
    gradient (its docstring says why), or as the backend's own tokens form where it has one (`cudnn_fa4`: a view,
    the probe having checked it with a strided gradient).
  * gated_residual: `x + gate * y` with one rounding.
  * gated_modulate: in the double block, the residual update after attention and the modulated LayerNorm of
    its result that feeds the MLP, in one kernel (the residual is recomputed in backward, not kept).
  * single_qkv: in the single block, linear1's output to q, k, v and GELU(mlp) as `flux_kernels.patches.single_qkv`: the
    same ops in the same order forward (QKNorm, RoPE, the MLP's GELU moved before attention, which does not read
    it), a backward written out for inductor; q, k and v's part of it one Triton kernel where Triton runs and
    the block is not checkpointed (there it measured slower).
  * double_qkv: in the double block, the same for both streams' qkv outputs: each stream normalised with its
    QKNorm, txt then img concatenated, RoPE over the whole sequence, as sd-scripts; the backward's Triton kernel
    runs once per stream on that stream's tokens. Not in checkpointed blocks, which keep sd-scripts' ops.
With every switch off the patched forward is bit-identical to sd-scripts' (a unit test checks this against
sd-scripts' blocks), and `verify_blocks` checks the installed result against the original on tiny inputs.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn

from flux_kernels.ops import fast, reference
from flux_kernels.patches import lora_fold
from flux_kernels.patches.attention.backends import heads_to_tokens
from flux_kernels.patches.blocks import ATTR, BLOCK_OPS, CHROMA, CHROMA_TAKES, IN_BLOCKS, find_blocks, patched_blocks
from flux_kernels.patches.single_qkv import double_qkv, single_qkv
from flux_kernels.patches.verify import verify_blocks
from flux_kernels.runtime.errors import KernelError

log = logging.getLogger(__name__)

RUN_PROBE = "_flux_kernels_attention_probe"  # the model's forward pre-hook handle (attention at the real shape)


@dataclass
class BlockOps:
    """The switches of one model, shared by all its patched blocks."""

    qk_norm_rope: bool = False
    modulate: bool = False
    gated_residual: bool = False
    gated_modulate: bool = False
    attention: Callable | None = None  # (q, k, v, mask) -> [B, H, L, D]; None = plain SDPA as sd-scripts
    single_qkv: bool = False
    double_qkv: bool = False

    def mod(self, x: Tensor, shift: Tensor, scale: Tensor, norm: nn.Module) -> Tensor:
        if self.modulate:
            return fast.modulate(x, shift, scale, norm.eps)
        return (1 + scale) * norm(x) + shift

    def gated(self, x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
        return fast.gated_residual(x, gate, y) if self.gated_residual else x + gate * y

    def gated_mod(self, x: Tensor, gate: Tensor, y: Tensor, shift: Tensor, scale: Tensor, norm: nn.Module):
        """The residual update and the modulated LayerNorm of its result: (x + gate * y, modulated)."""
        if self.gated_modulate:
            return fast.gated_modulate(x, gate, y, shift, scale, norm.eps)
        x = self.gated(x, gate, y)
        return x, self.mod(x, shift, scale, norm)

    def qk(self, streams: list[tuple[Tensor, Tensor, Tensor, nn.Module]], pe: Tensor) -> tuple[Tensor, Tensor]:
        """streams: (q, k, v, QKNorm module) in sequence order; returns the concatenated, rotated q and k."""
        if self.qk_norm_rope and all(q.dtype == v.dtype for q, _, v, _ in streams):
            segs = [(q, k, n.query_norm.scale, n.key_norm.scale) for q, k, _, n in streams]
            return fast.qk_norm_rope_cat(segs, pe)
        normed = [norm(q, k, v) for q, k, v, norm in streams]
        q = cat_tokens([q for q, _ in normed]) if len(normed) > 1 else normed[0][0]
        k = cat_tokens([k for _, k in normed]) if len(normed) > 1 else normed[0][1]
        return reference.apply_rope(q, k, pe)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        tokens = getattr(self.attention, "tokens", None)  # AttentionDispatch: the backend's tokens form, if any
        if tokens is not None:
            return tokens(q, k, v, mask)
        if self.attention is not None:
            x = self.attention(q, k, v, mask)
        else:
            x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return heads_to_tokens(x)


def cat_tokens(parts: list[Tensor]) -> Tensor:
    """sd-scripts' `torch.cat(parts, dim=2)` of [B, H, L_i, D] streams, the same values laid out token-major
    ([B, L, H, D] in memory, as the single blocks' q, k, v are, views of their projection): attention's output then
    comes out token-major too, which the blocks' "B H L D -> B L (H D)" takes as a view (`cudnn_fa4`: no copy of
    the double blocks' output, 19 x 36 us a step on the H200)."""
    return torch.cat([p.transpose(1, 2) for p in parts], dim=1).transpose(1, 2)


def _mask(txt_attention_mask: Tensor | None, rest: int, q: Tensor) -> Tensor | None:
    """sd-scripts' mask: text padding mask, all image tokens kept, broadcast to every head and query."""
    if txt_attention_mask is None:
        return None
    m = txt_attention_mask.to(torch.bool)
    m = torch.cat((m, torch.ones(m.shape[0], rest, device=m.device, dtype=torch.bool)), dim=1)
    return m[:, None, None, :].expand(-1, q.shape[1], q.shape[2], -1)


def double_after_attention(block: nn.Module, ops: BlockOps, img: Tensor, txt: Tensor, img_attn: Tensor,
                           txt_attn: Tensor, img_mods: tuple, txt_mods: tuple) -> tuple[Tensor, Tensor]:  # fmt: skip
    """A FLUX double block after its attention (FLUX.1's and Chroma's alike): each stream's projection, gated residual
    and modulated MLP."""
    (img_mod1, img_mod2), (txt_mod1, txt_mod2) = img_mods, txt_mods
    img, img_in = ops.gated_mod(img, img_mod1.gate, block.img_attn.proj(img_attn), img_mod2.shift, img_mod2.scale,
                                block.img_norm2)  # fmt: skip
    img = ops.gated(img, img_mod2.gate, block.img_mlp(img_in))
    txt, txt_in = ops.gated_mod(txt, txt_mod1.gate, block.txt_attn.proj(txt_attn), txt_mod2.shift, txt_mod2.scale,
                                block.txt_norm2)  # fmt: skip
    txt = ops.gated(txt, txt_mod2.gate, block.txt_mlp(txt_in))
    return img, txt


def _double_forward(self, img: Tensor, txt: Tensor, vec: Tensor, pe: Tensor, txt_attention_mask=None):
    ops: BlockOps = getattr(self, ATTR)
    img_mod1, img_mod2 = self.img_mod(vec)
    txt_mod1, txt_mod2 = self.txt_mod(vec)
    img_qkv = self.img_attn.qkv(ops.mod(img, img_mod1.shift, img_mod1.scale, self.img_norm1))
    txt_qkv = self.txt_attn.qkv(ops.mod(txt, txt_mod1.shift, txt_mod1.scale, self.txt_norm1))
    # checkpointed double blocks keep sd-scripts' ops: compiled, their autograd backward measured as fast as the
    # written-out torch one, and the Triton one was slower in checkpointed single blocks
    if ops.double_qkv and not ops.qk_norm_rope and not _checkpointed(self) and txt_qkv.dtype == img_qkv.dtype:
        tn, imn = self.txt_attn.norm, self.img_attn.norm
        q, k, v = double_qkv(txt_qkv, tn.query_norm.scale, tn.key_norm.scale, img_qkv, imn.query_norm.scale,
                             imn.key_norm.scale, pe, self.num_heads)  # fmt: skip
    else:
        img_q, img_k, img_v = reference.heads(img_qkv, self.num_heads)
        txt_q, txt_k, txt_v = reference.heads(txt_qkv, self.num_heads)
        q, k = ops.qk([(txt_q, txt_k, txt_v, self.txt_attn.norm), (img_q, img_k, img_v, self.img_attn.norm)], pe)
        v = cat_tokens([txt_v, img_v])
    attn = ops.attend(q, k, v, _mask(txt_attention_mask, img.shape[1], q))
    txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]

    return double_after_attention(self, ops, img, txt, img_attn, txt_attn, (img_mod1, img_mod2), (txt_mod1, txt_mod2))


def _single_forward(self, x: Tensor, vec: Tensor, pe: Tensor, txt_attention_mask=None) -> Tensor:
    ops: BlockOps = getattr(self, ATTR)
    mod, _ = self.modulation(vec)
    x_mod = ops.mod(x, mod.shift, mod.scale, self.pre_norm)
    q, k, v, act = single_qkv_act(self, ops, self.linear1(x_mod), pe)
    rest = x.shape[1] - (txt_attention_mask.shape[1] if txt_attention_mask is not None else 0)
    attn = ops.attend(q, k, v, _mask(txt_attention_mask, rest, q))
    return ops.gated(x, mod.gate, self.linear2(torch.cat((attn, act), 2)))


def single_qkv_act(block: nn.Module, ops: BlockOps, lin1: Tensor, pe: Tensor) -> tuple[Tensor, ...]:
    """A FLUX single block's linear1 output split into q, k (normed, RoPE'd), v and the MLP's activation (FLUX.1's
    and Chroma's alike): in one kernel where single_qkv runs, else in sd-scripts' ops."""
    if ops.single_qkv and not ops.qk_norm_rope and _gelu_tanh(block.mlp_act):
        norm = block.norm
        # GELU's gradient in the Triton kernel too where it comes out of one GEMM (linear2 mirror-folded)
        return single_qkv(lin1, norm.query_norm.scale, norm.key_norm.scale, pe, block.num_heads,
                          3 * block.hidden_size, triton_bwd=not _checkpointed(block),
                          gelu_in_kernel=lora_fold.folded_down(block.linear2))  # fmt: skip
    qkv, mlp = torch.split(lin1, [3 * block.hidden_size, block.mlp_hidden_dim], dim=-1)
    q, k, v = reference.heads(qkv, block.num_heads)
    q, k = ops.qk([(q, k, v, block.norm)], pe)
    return q, k, v, block.mlp_act(mlp)


def _checkpointed(block: nn.Module) -> bool:
    """The block recomputes its forward in the backward (sd-scripts' flag): there single blocks keep single_qkv's
    torch backward and double blocks sd-scripts' ops, which measured faster than the Triton kernel there."""
    return block.training and getattr(block, "gradient_checkpointing", False)


def _gelu_tanh(m: nn.Module) -> bool:
    """The single block's MLP activation is what single_qkv computes (sd-scripts': nn.GELU(approximate="tanh"))."""
    return type(m) is nn.GELU and m.approximate == "tanh"


def _ops_of(model: nn.Module) -> BlockOps:
    """The model's BlockOps, patching every block's `_forward` on first use (Chroma's blocks: those that
    flux_kernels.patches.chroma gave our forward, which reads the same switches)."""
    double, single = find_blocks(model)
    if not double and not single:
        chroma = [b for b in sum(patched_blocks(model), []) if hasattr(b, ATTR)]
        if chroma:
            return getattr(chroma[0], ATTR)
        raise ValueError(f"{type(model).__name__} has no FLUX double/single-stream blocks to patch")
    shared = next((getattr(b, ATTR) for b in double + single if hasattr(b, ATTR)), None) or BlockOps()
    for blocks, fwd in ((double, _double_forward), (single, _single_forward)):
        for b in blocks:
            if not hasattr(b, ATTR):
                setattr(b, ATTR, shared)
                b._forward = MethodType(fwd, b)
    return shared


def install_block_op(model: nn.Module, op: str, **opts) -> str:
    """One switch: turn on `op` (one of BLOCK_OPS) in every block. Attention options: `cache_path`, and
    `shapes` [(B, H, L, D), ...] with `dtype` / `with_mask` / `device` to probe up front (else at first use)."""
    if op not in BLOCK_OPS:
        raise ValueError(f"unknown block op {op!r}; choose from {', '.join(BLOCK_OPS)}")
    ops = _ops_of(model)
    if op == "attention":
        from flux_kernels.patches.attention.dispatch import AttentionDispatch

        device = opts.get("device") or next(model.parameters()).device  # the GPU, even if the model is not there yet
        dispatch = AttentionDispatch(cache_path=opts.get("cache_path"), device=device)
        for shape in opts.get("shapes", ()):
            dispatch.prepare(tuple(shape), opts.get("dtype", torch.bfloat16), device, opts.get("with_mask", False))
        ops.attention = dispatch
        _remove_run_probe(model)
        model.__dict__[RUN_PROBE] = model.register_forward_pre_hook(
            functools.partial(_decide_attention, dispatch), with_kwargs=True
        )
    else:
        setattr(ops, op, True)
    double, single = patched_blocks(model)
    return f"{op}: {len(double)} double + {len(single)} single blocks"


def attention_shape(model: nn.Module, args: tuple, kwargs: dict):
    """(B, H, L, D), dtype, device and whether a mask is passed, of the attention inside the blocks of a FLUX model
    called with `args` / `kwargs` (sd-scripts' `Flux.forward(img, img_ids, txt, txt_ids, ..., txt_attention_mask)`):
    L is the image plus text tokens, the dtype autocast's if it is on. None when the call does not look like that."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    img, txt = bound.get("img"), bound.get("txt")
    heads, hidden = getattr(model, "num_heads", None), getattr(model, "hidden_size", None)
    if not (isinstance(img, Tensor) and isinstance(txt, Tensor) and img.dim() == txt.dim() == 3 and heads and hidden):
        return None
    kind = img.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else img.dtype
    n_txt, with_mask = txt.shape[1], bound.get("txt_attention_mask") is not None
    chroma = _chroma_text(model, bound, txt)
    if chroma is not None:
        n_txt, with_mask = chroma
    shape = (img.shape[0], int(heads), img.shape[1] + n_txt, int(hidden) // int(heads))
    return shape, dtype, img.device, with_mask


def _chroma_text(model: nn.Module, bound: Mapping[str, Any], txt: Tensor) -> tuple[int, bool] | None:
    """Chroma's forward (it takes `attn_padding`) trims the text to the longest caption plus `attn_padding`, and
    chroma_blocks masks the padding only where there are several samples: (text tokens, whether a mask is passed).
    One read of the mask back to the host, once, at the first training call (Chroma's forward reads it anyway)."""
    params = inspect.signature(model.forward).parameters
    mask = bound.get("txt_attention_mask")
    if "attn_padding" not in params or not isinstance(mask, Tensor):
        return None
    pad = bound.get("attn_padding", params["attn_padding"].default)
    longest = int(mask[:, : txt.shape[1]].sum(dim=-1).max()) + int(pad)
    return max(0, min(txt.shape[1], longest)), txt.shape[0] > 1


def _decide_attention(dispatch, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook on the FLUX model: at its first training call (grad enabled: a sample rendered before
    training is at another shape, and with several GPUs only some ranks render one, while deciding is a collective),
    before the training blocks are traced, probe attention at the run's shape (see AttentionDispatch). Eager,
    outside the compiled blocks; after that one decision it only reads an attribute."""
    ready = dispatch.run_choice is None and torch.is_grad_enabled()
    if ready and (found := attention_shape(model, args, kwargs)) is not None:
        dispatch.decide_run(*found)


def _remove_run_probe(model: nn.Module) -> None:
    handle = model.__dict__.pop(RUN_PROBE, None)
    if handle is not None:
        handle.remove()


def attention_decision(model: nn.Module) -> str | None:
    """What the attention probe chose at the run's first forward, in words (None before it, or without the kernel)."""
    for b in model.modules():
        ops = getattr(b, ATTR, None)
        if ops is not None:
            return getattr(ops.attention, "run_line", None)
    return None


def install_fp8(model: nn.Module, quantize: bool = False, device=None, keep_transposed: bool = False, **_) -> str:
    """fp8 frozen matmuls (flux_kernels.patches.fp8) in every block's token-wise Linear layers; `quantize` also converts
    high-precision weights (on `device`, e.g. the GPU, when given); `keep_transposed` keeps each weight's transpose
    for the input gradient (+1 byte per weight). What is made on `device` stays there unless the model swaps
    blocks (sd-scripts moves the rest of the model to the GPU next; with block swap some blocks stay on the host)."""
    from flux_kernels.patches import fp8

    double, single = patched_blocks(model)
    if not double and not single:
        raise ValueError(f"{type(model).__name__} has no FLUX double/single-stream blocks to patch")
    blocks = double + single
    stay = not getattr(model, "blocks_to_swap", None)
    done, skipped, note = fp8.install(
        blocks, quantize=quantize, device=device, keep_transposed=keep_transposed, stay=stay
    )
    if not done:
        raise KernelError(f"fp8_matmul: none of the {skipped} block Linear layers qualify (fp8 weights, "
                          "frozen, dimensions multiples of 16)")  # fmt: skip
    return f"fp8_matmul: {done} Linear layers of {len(double)} double + {len(single)} single blocks ({note})"


def install_lora_norms(model: nn.Module, **_) -> str:
    """sd-scripts' per-step LoRA gradient row norms from rank-sized factors (flux_kernels.patches.lora_norms)."""
    from flux_kernels.patches import lora_norms

    done, skipped = lora_norms.install(model)
    if not done:
        raise KernelError("lora_grad_norms: no LoRA module (2-D lora_up/lora_down) is applied to this model")
    return f"lora_grad_norms: {done} LoRA modules" + (f" ({skipped} conv LoRA left as they are)" if skipped else "")


def install_lora_fold(model: nn.Module, **_) -> str:
    """A LoRA factor folded into the frozen GEMM where the output is much wider than the input (B; FLUX's
    single-block linear1) or the input much wider than the output (A; linear2, the MLPs' second layer):
    flux_kernels.patches.lora_fold."""
    from flux_kernels.patches import lora_fold

    if getattr(model, "blocks_to_swap", None):
        why = "block swap moves frozen weights every step; a folded layer keeps its weight in a buffer beside B"
        raise KernelError(f"lora_fold: {why} (drop lora_fold or block swap)")
    done = lora_fold.install(model)
    if not done:
        raise KernelError(f"lora_fold: no plain LoRA on a frozen Linear with {lora_fold.FOLDABLE}")
    sides = lora_fold.sides(model)
    return (
        f"lora_fold: {done} LoRA Linear layers ({sides['up']} with B, {sides['down']} with A inside the frozen "
        "GEMM; re-homed at the first forward)"
    )


def remove_kernels(model: nn.Module) -> list[str]:
    """Undo everything `apply_kernels` did: blocks get sd-scripts' class `_forward` back and lose compilation,
    Linear layers get their forward back (weights that fp8_matmul quantised stay fp8)."""
    from flux_kernels.memory import activation_offload, block_swap
    from flux_kernels.memory import selective_checkpoint as sac
    from flux_kernels.patches import compile_blocks, fp8, lora_fold, lora_norms, prologue

    undone = ["block_swap"] if block_swap.remove(model) else []
    undone += ["fp8"] if fp8.uninstall(model) else []
    undone += ["activation_offload"] if activation_offload.remove(model) else []
    undone += ["selective_checkpoint"] if sac.remove(model) else []
    undone += ["lora_fold"] if lora_fold.uninstall(model) else []
    undone += compile_blocks.remove(model)
    undone += ["lora_norms"] if lora_norms.uninstall(model) else []
    undone += ["flux_prologue"] if prologue.uninstall(model) else []
    _remove_run_probe(model)
    for b in model.modules():
        if hasattr(b, ATTR):
            delattr(b, ATTR)
            b.__dict__.pop("_forward", None)
            undone.append("patch")
    return sorted(set(undone))


def apply_kernels(
    flux_model: nn.Module,
    selection,
    *,
    options: Mapping[str, Mapping] | None = None,
    verify: bool = True,
    seconds: dict[str, float] | None = None,
) -> list[str]:
    """Install `selection.specs` (from `registry.select`) into `flux_model`; returns the installed names.
    `options` maps a kernel name to its install options. With `verify`, the patched blocks are first checked
    against sd-scripts' own forward; if they differ, the block patches are undone and then, for kernels the
    user named, KernelError is raised, while for `auto` one warning says so and training goes on without them.
    `compile_blocks` is installed after the other patches, so what it compiles includes them (only
    `activation_offload`, which wraps the compiled calls, comes after it). `seconds`, when given, receives the wall
    time of each install (by kernel name) and of the verification ("verify")."""
    seconds = {} if seconds is None else seconds

    def timed(name: str, work: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return work()
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

    options = {name: dict(o) for name, o in (options or {}).items()}
    insists = getattr(selection, "insists", None) or (lambda name: getattr(selection, "explicit", True))
    if getattr(selection, "device", None) is not None:  # probe attention where training runs, not where the model is
        for name in ("attention", "fp8_matmul"):
            options.setdefault(name, {}).setdefault("device", selection.device.torch_device)
    options.setdefault("fp8_matmul", {}).setdefault("quantize", insists("fp8_matmul"))  # named: a bf16 base too

    def applies(spec) -> bool:
        """auto's condition for `spec`, on the model as the kernels installed before it left it (fp8_matmul takes
        the layers lora_fold would fold)."""
        auto_if = getattr(spec, "auto_if", None)
        if spec.name in IN_BLOCKS and not any(find_blocks(flux_model)):
            why = None
            if not any(patched_blocks(flux_model)):  # Chroma's without chroma_blocks, or no blocks at all
                why = "no FLUX.1 double/single blocks (Chroma's have another shape)"
            elif spec.name not in CHROMA_TAKES:  # Chroma's blocks with our forward, which does not read this one
                why = f"not made for Chroma's blocks (these work in them: {', '.join(CHROMA_TAKES)})"
            if why is not None:
                if insists(spec.name):
                    raise KernelError(f"{spec.name}: {why}; remove it from kernels=")
                log.info("kernel %s skipped: %s", spec.name, why)
                return False
        if insists(spec.name):
            return True
        if auto_if is None:
            return True
        ok, why = auto_if(flux_model)
        if not ok:
            log.info("kernel %s skipped: %s", spec.name, why)
        return ok

    # chroma_blocks first: the block ops then judge (and switch on) Chroma's blocks with our forward in them
    block_specs = [s for s in selection.specs if s.name == CHROMA and applies(s)]
    lines = [timed(s.name, lambda s=s: s.install(flux_model, **options.get(s.name, {}))) for s in block_specs]
    ops_specs = [s for s in selection.specs if s.name in BLOCK_OPS and applies(s)]
    lines += [timed(s.name, lambda s=s: s.install(flux_model, **options.get(s.name, {}))) for s in ops_specs]
    block_specs += ops_specs
    if verify and block_specs:
        try:
            for note in timed("verify", lambda: verify_blocks(flux_model)):
                log.warning("flux_kernels: %s", note)
        except ValueError as e:
            remove_kernels(flux_model)
            names = ", ".join(s.name for s in block_specs)
            if any(insists(s.name) for s in block_specs):
                raise KernelError(f"kernels {names} failed verification: {e}; remove them from kernels=") from e
            log.warning("flux_kernels: %s not installed: %s", names, e)
            block_specs, lines = [], []
    installed = list(block_specs)
    for spec in selection.specs:
        if spec.name not in (*BLOCK_OPS, CHROMA) and applies(spec):  # in order, each judged after the ones before it
            try:
                lines.append(timed(spec.name, lambda spec=spec: spec.install(flux_model, **options.get(spec.name, {}))))
            except KernelError as e:  # refused before changing anything (block_swap: no page-locked memory)
                if insists(spec.name):
                    raise
                log.warning("flux_kernels: %s not installed (auto goes on without it): %s", spec.name, e)
                continue
            installed.append(spec)
    for line in lines:
        log.info("flux_kernels installed %s", line)
    return [s.name for s in selection.specs if s in installed]
