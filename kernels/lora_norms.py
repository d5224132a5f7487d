"""The LoRA weight-gradient row norms sd-scripts computes after every backward, without the full-size products.

sd-scripts' FLUX LoRA (networks/lora_flux.py, `LoRAModule.update_grad_norms`, called by train_network.py on every
optimizer step whatever the settings) forms, per LoRA module, the approximate gradient of the merged weight

    G = scale * (up @ d_down + d_up @ down)          [out, in]: the size of the frozen weight

and keeps `norm(G, dim=1)` (its mean is logged as `norm/avg_grad_norm`; GGPO, when configured, scales its
perturbation with it). On FLUX that is 304 weight-sized products, additions, scalings and norms per step: measured
55 ms of a 0.43 s step on an H200 (profile at 1024², LoRA r16). The same norms come from rank-sized factors:

    G = scale * A @ B,  A = [up, d_up] [out, 2r],  B = [d_down; down] [2r, in]
    |G_i|^2 = scale^2 * A_i (B B^T) A_i^T

so one [2r, 2r] Gram matrix per module replaces the [out, in] product. Both this and the reference work in float64
(a few MFLOP per module here), so TF32, which the launcher allows on Ampere and newer, cannot round them; sd-scripts'
version runs under autocast in fp16 on a GPU, so the logged value moves in its 3rd-4th digit.

Nothing here imports sd-scripts: LoRA modules are recognised by what they have (`lora_up`, `lora_down`, `scale`,
`update_grad_norms`) on the Linear layers whose `forward` they replaced.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import Tensor, nn

ATTR = "_flux_lora_norms"


def reference_row_norms(up: Tensor, down: Tensor, d_up: Tensor, d_down: Tensor, scale: float) -> Tensor:
    """The plain computation, in float64: row norms of scale * (up @ d_down + d_up @ down), [out, 1] float32."""
    up, down, d_up, d_down = (t.double() for t in (up, down, d_up, d_down))
    return torch.norm(scale * (up @ d_down + d_up @ down), dim=1, keepdim=True).float()


def row_norms(up: Tensor, down: Tensor, d_up: Tensor, d_down: Tensor, scale: float) -> Tensor:
    """The same norms through the [2r, 2r] Gram matrix of [d_down; down]: O(out r^2 + in r^2), not O(out in r)."""
    a = torch.cat([up, d_up], dim=1).double()  # [out, 2r]
    b = torch.cat([d_down, down], dim=0).double()  # [2r, in]
    squared = ((a @ (b @ b.t())) * a).sum(dim=1, keepdim=True)
    return (squared.clamp_min(0).sqrt() * abs(float(scale))).float()


def _is_lora(m: object) -> bool:
    return all(hasattr(m, a) for a in ("lora_up", "lora_down", "scale", "update_grad_norms"))


def _fast_update_grad_norms(self) -> None:
    """sd-scripts' LoRAModule.update_grad_norms, same semantics (skip when not training, need both gradients, set
    `self.grad_norms` [out, 1]), computed by `row_norms`."""
    if not self.training:
        return
    up, down = self.lora_up.weight, self.lora_down.weight
    if up.grad is None or down.grad is None:
        return
    self.grad_norms = row_norms(up, down, up.grad, down.grad, self.scale).to(up.dtype)


def lora_modules(model: nn.Module) -> list[nn.Module]:
    """The LoRA modules applied to `model`'s layers, each once (a LoRA replaces its layer's `forward` with its own)."""
    found: dict[int, nn.Module] = {}
    for m in model.modules():
        wrapper = getattr(m.__dict__.get("forward"), "__self__", None)
        if wrapper is not None and _is_lora(wrapper):
            found.setdefault(id(wrapper), wrapper)
    return list(found.values())


def install(model: nn.Module) -> tuple[int, int]:
    """Give each 2-D LoRA module on `model` the fast `update_grad_norms`; returns (patched, skipped)."""
    done = skipped = 0
    for lora in lora_modules(model):
        if lora.lora_up.weight.dim() != 2 or lora.lora_down.weight.dim() != 2:
            skipped += 1  # conv LoRA: sd-scripts' own product does not apply to it either
            continue
        if ATTR not in lora.__dict__:
            lora.__dict__[ATTR] = lora.__dict__.get("update_grad_norms")
            lora.update_grad_norms = MethodType(_fast_update_grad_norms, lora)
        done += 1
    return done, skipped


def uninstall(model: nn.Module) -> int:
    undone = 0
    for lora in lora_modules(model):
        if ATTR in lora.__dict__:
            previous = lora.__dict__.pop(ATTR)
            lora.__dict__.pop("update_grad_norms", None)
            if previous is not None:
                lora.update_grad_norms = previous
            undone += 1
    return undone
