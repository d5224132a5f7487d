"""What a FLUX block is, and where a patched one keeps its switches.

Blocks are found by what they have, not by importing sd-scripts: a double-stream block has `img_mod`, `txt_mod`,
`img_attn`, `txt_attn`, `img_mlp`, `txt_mlp`; a single-stream block has `linear1`, `linear2`, `pre_norm`,
`modulation`, `norm` (and the signature of its class's `_forward`). Everything that installs into the blocks
(`patch`, `compile_blocks`, the memory strategies) finds them here.
"""

from __future__ import annotations

import inspect

from torch import nn

ATTR = "_flux_kernels"
BLOCK_OPS = ("qk_norm_rope", "modulate", "gated_residual", "gated_modulate", "attention", "single_qkv", "double_qkv")
# kernels that work inside FLUX.1's double/single blocks: with none found (Chroma's blocks take their modulation as
# an argument and trim the text per sample, another shape), `auto` skips them
IN_BLOCKS = (*BLOCK_OPS, "fp8_matmul", "compile_blocks", "selective_checkpoint", "activation_offload", "block_swap")
CHROMA = "chroma_blocks"  # our forward for Chroma's blocks (flux_kernels.patches.chroma): what lets the rest in
# of IN_BLOCKS, those that work in Chroma's blocks once chroma_blocks has given them our forward (the others skip)
CHROMA_TAKES = ("attention", "qk_norm_rope", "modulate", "gated_residual", "gated_modulate", "single_qkv",
                "fp8_matmul", "compile_blocks")  # fmt: skip
TRITON_BLOCK_OPS = ("qk_norm_rope", "modulate", "gated_residual", "gated_modulate")  # fast.py's fused Triton ops
DOUBLE_ATTRS = ("img_mod", "txt_mod", "img_norm1", "txt_norm1", "img_attn", "txt_attn", "img_norm2", "txt_norm2",
                "img_mlp", "txt_mlp", "num_heads")  # fmt: skip
DOUBLE_PARAMS = ("self", "img", "txt", "vec", "pe", "txt_attention_mask")
SINGLE_PARAMS = ("self", "x", "vec", "pe", "txt_attention_mask")
CHROMA_DOUBLE_PARAMS = ("self", "img", "txt", "pe", "distill_vec", "txt_seq_len")
CHROMA_SINGLE_PARAMS = ("self", "x", "pe", "distill_vec", "txt_seq_len")
SINGLE_ATTRS = ("linear1", "linear2", "pre_norm", "modulation", "norm", "mlp_act", "hidden_size", "mlp_hidden_dim",
                "num_heads")  # fmt: skip


def _is_plain_layernorm(m) -> bool:
    return isinstance(m, nn.LayerNorm) and m.weight is None and m.bias is None


def _forward_params(m: nn.Module) -> tuple[str, ...]:
    fn = getattr(type(m), "_forward", None)
    try:
        return tuple(inspect.signature(fn).parameters) if fn is not None else ()
    except (TypeError, ValueError):
        return ()


def block_kind(m: nn.Module) -> str | None:
    """ "double", "single" or None, by attributes and by the signature of the class's `_forward` (sd-scripts'
    classes are never imported; a block of another shape, e.g. Chroma's, is left alone)."""
    params = _forward_params(m)
    if all(hasattr(m, a) for a in DOUBLE_ATTRS) and params == DOUBLE_PARAMS:
        norms = (m.img_norm1, m.txt_norm1, m.img_norm2, m.txt_norm2)
        return "double" if all(_is_plain_layernorm(n) for n in norms) else None
    if all(hasattr(m, a) for a in SINGLE_ATTRS) and params == SINGLE_PARAMS:
        return "single" if _is_plain_layernorm(m.pre_norm) else None
    return None


def find_blocks(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    double, single = [], []
    for m in model.modules():
        kind = block_kind(m)
        if kind == "double":
            double.append(m)
        elif kind == "single":
            single.append(m)
    return double, single


def chroma_kind(m: nn.Module) -> str | None:
    """ "double", "single" or None for a Chroma block (sd-scripts' `library/chroma_models`): FLUX.1's attributes
    less the modulation layers (`img_mod`, `txt_mod`, `modulation`), whose output comes in as `distill_vec`, and the
    captions' lengths as `txt_seq_len`, by the signature of the class's `_forward`."""
    params = _forward_params(m)
    double_attrs = [a for a in DOUBLE_ATTRS if a not in ("img_mod", "txt_mod")]
    if params == CHROMA_DOUBLE_PARAMS and all(hasattr(m, a) for a in double_attrs):
        norms = (m.img_norm1, m.txt_norm1, m.img_norm2, m.txt_norm2)
        return "double" if all(_is_plain_layernorm(n) for n in norms) else None
    single_attrs = [a for a in SINGLE_ATTRS if a != "modulation"]
    if params == CHROMA_SINGLE_PARAMS and all(hasattr(m, a) for a in single_attrs):
        return "single" if _is_plain_layernorm(m.pre_norm) else None
    return None


def find_chroma_blocks(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    double, single = [], []
    for m in model.modules():
        kind = chroma_kind(m)
        if kind == "double":
            double.append(m)
        elif kind == "single":
            single.append(m)
    return double, single


def patched_blocks(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The blocks the kernels inside blocks work on: FLUX.1's, or else Chroma's where chroma_blocks has given them
    our forward (the `ATTR` it sets); ([], []) for a Chroma model without it."""
    double, single = find_blocks(model)
    if double or single:
        return double, single
    double, single = find_chroma_blocks(model)
    return [b for b in double if hasattr(b, ATTR)], [b for b in single if hasattr(b, ATTR)]
