"""`chroma_blocks`: our forward for Chroma's double and single blocks (sd-scripts' `library/chroma_models`), the same
attention with a mask over the captions' padding instead of a per-sample loop, so that the blocks compile into one
graph each and the other kernels inside blocks (the attention backend, the fused ops, single_qkv, fp8_matmul,
compile_blocks) reach them.

What sd-scripts' Chroma blocks compute. The model's forward turns the T5 mask into each caption's length
`txt_seq_len = clip(mask.sum() + attn_padding, 0, T)` (`attn_padding` 1: one padding token is attended to), trims the
text to the longest of these (so `txt.shape[1] == max(txt_seq_len)`) and puts the image tokens first, the text after
them (`pe` in that order too). Each block then, sample by sample, cuts the text to that sample's length, attends over
image + kept text (RoPE on those rows of `pe`), and writes the result into zeros: a padded text token's attention
output is 0 (its projection then adds only the bias), and no token attends to it. Each block reads the longest length
back with `.item()` (a host sync, a graph break under torch.compile) and slices by per-sample lengths (more syncs,
data-dependent shapes).

Ours: the whole batch at once, a key mask that leaves out the same padded tokens (softmax over the kept keys is the
trimmed attention), and the output at padded query positions set to 0, as sd-scripts leaves it: the same values at
every position, image and text, padded or not (RoPE is per row, so rotating all rows and keeping some is rotating
those rows). Text position t of sample i is kept where t < txt_seq_len[i]; in the single block the text starts at
L - max(txt_seq_len), computed on the device. With one sample the text is exactly its caption's kept length (the
model trimmed it so), so nothing is padded and no mask is passed: the same call as FLUX.1's blocks, any attention
backend. The modulation and residual steps are BlockOps' (flux_kernels.patches.patch), which are sd-scripts'
`(1 + scale) * norm(x) + shift` and `x + gate * y` in its order, or the fused ops where those are switched on.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import Tensor, nn

from flux_kernels.ops import reference
from flux_kernels.patches.attention.backends import heads_to_tokens
from flux_kernels.patches.blocks import ATTR, find_chroma_blocks
from flux_kernels.patches.patch import BlockOps, cat_tokens, double_after_attention, single_qkv_act
from flux_kernels.runtime.errors import KernelError


def kept_text(txt_seq_len: Tensor, n_img: int, n_txt: int) -> Tensor | None:
    """[B, n_img + n_txt] bool: the tokens a Chroma block attends to, image first then text (text token t of sample
    i kept where t < txt_seq_len[i]). None with one sample, where the model's trim leaves no padding."""
    if txt_seq_len.shape[0] == 1:
        return None
    pos = torch.arange(n_txt, device=txt_seq_len.device)
    txt = pos[None, :] < txt_seq_len[:, None]
    return torch.cat((torch.ones(txt.shape[0], n_img, dtype=torch.bool, device=txt.device), txt), dim=1)


def kept_single(txt_seq_len: Tensor, length: int) -> Tensor | None:
    """kept_text for the single block's joined tokens [B, length]: the text is the last max(txt_seq_len) of them."""
    if txt_seq_len.shape[0] == 1:
        return None
    pos = torch.arange(length, device=txt_seq_len.device)
    end = length - txt_seq_len.max() + txt_seq_len  # image tokens + this sample's kept text
    return pos[None, :] < end[:, None]


def masked_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, ops: BlockOps | None = None) -> Tensor:
    """Attention over the kept keys, 0 at the other query positions, as tokens [B, L, H * D]: q, k, v [B, H, L, D]
    (RoPE applied), `keep` [B, L] or None (all kept)."""
    ops = ops or BlockOps()
    mask = None if keep is None else keep[:, None, None, :].expand(-1, q.shape[1], q.shape[2], -1)
    out = ops.attend(q, k, v, mask)
    return out if keep is None else torch.where(keep[..., None], out, torch.zeros((), dtype=out.dtype,
                                                                                  device=out.device))  # fmt: skip


def reference_trimmed_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """The reference for `masked_attention`: sample by sample, only the kept tokens (a prefix of the image tokens
    and this sample's text, wherever they are), plain SDPA over them, 0 elsewhere."""
    if keep is None:
        return heads_to_tokens(torch.nn.functional.scaled_dot_product_attention(q, k, v))
    out = q.new_zeros(q.shape[0], q.shape[2], q.shape[1] * q.shape[3])
    rows = []
    for i in range(q.shape[0]):
        idx = keep[i].nonzero().squeeze(1)
        qi, ki, vi = (t[i : i + 1, :, idx] for t in (q, k, v))
        o = heads_to_tokens(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi))[0]
        rows.append(out[i].index_put((idx,), o))
    return torch.stack(rows)


def _double_forward(self, img: Tensor, txt: Tensor, pe: Tensor, distill_vec, txt_seq_len: Tensor):
    ops: BlockOps = getattr(self, ATTR)
    (img_mod1, img_mod2), (txt_mod1, txt_mod2) = distill_vec
    img_qkv = self.img_attn.qkv(ops.mod(img, img_mod1.shift, img_mod1.scale, self.img_norm1))
    txt_qkv = self.txt_attn.qkv(ops.mod(txt, txt_mod1.shift, txt_mod1.scale, self.txt_norm1))
    img_q, img_k, img_v = reference.heads(img_qkv, self.num_heads)
    txt_q, txt_k, txt_v = reference.heads(txt_qkv, self.num_heads)
    q, k = ops.qk([(img_q, img_k, img_v, self.img_attn.norm), (txt_q, txt_k, txt_v, self.txt_attn.norm)], pe)
    v = cat_tokens([img_v, txt_v])
    attn = masked_attention(q, k, v, kept_text(txt_seq_len, img.shape[1], txt.shape[1]), ops)
    img_attn, txt_attn = attn[:, : img.shape[1]], attn[:, img.shape[1] :]

    return double_after_attention(self, ops, img, txt, img_attn, txt_attn, (img_mod1, img_mod2), (txt_mod1, txt_mod2))


def _single_forward(self, x: Tensor, pe: Tensor, distill_vec, txt_seq_len: Tensor) -> Tensor:
    ops: BlockOps = getattr(self, ATTR)
    mod = distill_vec
    q, k, v, act = single_qkv_act(self, ops, self.linear1(ops.mod(x, mod.shift, mod.scale, self.pre_norm)), pe)
    attn = masked_attention(q, k, v, kept_single(txt_seq_len, x.shape[1]), ops)
    return ops.gated(x, mod.gate, self.linear2(torch.cat((attn, act), 2)))


def install(model: nn.Module, **_) -> str:
    """Our forward on every Chroma block (the instance's `_forward` shadows the class's, so sd-scripts' `forward`
    still decides about checkpointing and its block swap still moves the weights), with the BlockOps switches the
    other block kernels turn on. KernelError where the model has no Chroma blocks."""
    double, single = find_chroma_blocks(model)
    if not double and not single:
        raise KernelError(f"chroma_blocks: {type(model).__name__} has no Chroma double/single blocks")
    shared = next((getattr(b, ATTR) for b in double + single if hasattr(b, ATTR)), None) or BlockOps()
    for blocks, fwd in ((double, _double_forward), (single, _single_forward)):
        for b in blocks:
            if not hasattr(b, ATTR):
                setattr(b, ATTR, shared)
                b._forward = MethodType(fwd, b)
    return (
        f"chroma_blocks: {len(double)} double + {len(single)} single Chroma blocks attend with a mask over the "
        "captions' padding (no per-sample loop, no host sync)"
    )


def has_chroma_blocks(model: nn.Module) -> tuple[bool, str]:
    """auto_if: only a Chroma model has these blocks."""
    double, single = find_chroma_blocks(model)
    if double or single:
        return True, f"{len(double)} double + {len(single)} single Chroma blocks"
    return False, "no Chroma blocks (FLUX.1's blocks have their own forward)"
