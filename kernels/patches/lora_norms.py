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

import functools
import logging
import weakref

import torch
from torch import Tensor, nn

from flux_kernels.ops import fast
from flux_kernels.runtime.device import triton_runs_on

ATTR = "_flux_lora_norms"
log = logging.getLogger(__name__)


def reference_row_norms(up: Tensor, down: Tensor, d_up: Tensor, d_down: Tensor, scale: float) -> Tensor:
    """The plain computation, in float64: row norms of scale * (up @ d_down + d_up @ down), [out, 1] float32."""
    up, down, d_up, d_down = (t.double() for t in (up, down, d_up, d_down))
    return torch.norm(scale * (up @ d_down + d_up @ down), dim=1, keepdim=True).float()


def row_norms(up: Tensor, down: Tensor, d_up: Tensor, d_down: Tensor, scale: float) -> Tensor:
    """The same norms through the [2r, 2r] Gram matrix of [d_down; down]: O(out r^2 + in r^2), not O(out in r)."""
    return batched_row_norms([up], [down], [d_up], [d_down], scale)[0]


@torch.no_grad()
def batched_row_norms(ups, downs, d_ups, d_downs, scale: float, triton: bool | None = None) -> Tensor:
    """`row_norms` of k modules of one shape and scale in a few batched ops: [k, out, 1] float32. One call per
    weight shape instead of a dozen small kernels per module: FLUX's 304 modules have 7 shapes; module by module
    the launches took 58 ms of wall time a step, batched 3.6 ms (H200), and the step went from 0.428 to 0.381 s.

    Where Triton runs, the out-sized side is one kernel (`tl_lora_norms`): it reads the stacked up factors and
    gradients once in their own dtype and does the same float64 math in registers, where the torch path writes and
    reads float64 copies of them several times (~3 ms of device time a step on FLUX, H200). `triton` forces one
    side (None: the kernel where it can run)."""
    b = torch.cat([torch.stack(d_downs), torch.stack(downs)], dim=1).double()  # [k, 2r, in]
    gram = torch.bmm(b, b.transpose(1, 2))  # [k, 2r, 2r]
    stacked_ups = torch.stack(ups)
    auto = triton is None
    if auto:
        triton = triton_runs_on(stacked_ups.device) and _gram_kernel_takes(stacked_ups) and not _KERNEL_FAILED
    if triton:
        launchers, _ = fast._ops_lib()
        try:
            return launchers.gram_row_norms(stacked_ups, torch.stack(d_ups), gram, scale)
        except Exception as err:  # noqa: BLE001 - a card Triton cannot compile it for: the torch ops, said once
            if not auto:
                raise
            _kernel_failed(err, stacked_ups.device)
    a = torch.cat([stacked_ups, torch.stack(d_ups)], dim=2).double()  # [k, out, 2r]
    squared = (torch.bmm(a, gram) * a).sum(dim=2, keepdim=True)
    return (squared.clamp_min_(0).sqrt_() * abs(float(scale))).float()


_KERNEL_FAILED = False  # set once the kernel failed to compile or launch in this process: the torch ops from then on


def _kernel_failed(err: Exception, device: torch.device) -> None:
    """Log once why the kernel is left for the torch ops (Triton 3.7 cannot compile its float64 dots for sm_100 at
    rank 16, for one: its matmul pass fails)."""
    global _KERNEL_FAILED
    _KERNEL_FAILED = True
    log.warning("lora_grad_norms: the Triton kernel failed on %s (%s: %s); the float64 torch ops compute the norms "
                "instead", device, type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")  # fmt: skip


def _gram_kernel_takes(ups: Tensor) -> bool:
    """The kernel's dtypes, and ranks it holds in registers (up to 64)."""
    return ups.dtype in (torch.float32, torch.bfloat16, torch.float16) and ups.shape[-1] <= 64


def _is_lora(m: object) -> bool:
    return all(hasattr(m, a) for a in ("lora_up", "lora_down", "scale", "update_grad_norms"))


class _Shared:
    """The patched LoRA modules of one model. sd-scripts calls `update_grad_norms` on each module in turn after
    the backward; the first call whose gradients are new computes every module's norms, grouped by shape, and
    each call takes its own row. "New" is judged by the gradient tensors' identity and version counters, so
    gradients replaced (zero_grad(set_to_none)) or changed in place (accumulation, zero_) are never served stale."""

    def __init__(self, loras: list[nn.Module]):
        self.loras = loras
        self.norms: dict[int, Tensor] = {}
        self.stamps: dict[int, tuple] = {}
        self.means: list[Tensor] = []  # per shape group [k, 1]: each module's mean row norm (see stacked_means)
        self.rows: dict[int, int] = {}  # module id -> its row in torch.cat(self.means)
        self._gathers: dict[tuple, Tensor] = {}

    @staticmethod
    def _grads(m) -> tuple[Tensor, Tensor] | None:
        up, down = m.lora_up.weight.grad, m.lora_down.weight.grad
        return None if up is None or down is None else (up, down)

    def _fresh(self, m, grads: tuple[Tensor, Tensor]) -> bool:
        stamp = self.stamps.get(id(m))
        if stamp is None:
            return False
        return all(ref() is g and version == g._version for (ref, version), g in zip(stamp, grads, strict=True))

    @torch.no_grad()
    @torch.profiler.record_function("flux_kernels::lora_grad_norms")
    def _compute_all(self) -> None:
        groups: dict[tuple, list] = {}
        self.norms, self.stamps, self.means, self.rows = {}, {}, [], {}
        for m in self.loras:
            grads = self._grads(m)
            if not m.training or grads is None:
                continue
            up, down = m.lora_up.weight, m.lora_down.weight
            key = (tuple(up.shape), tuple(down.shape), up.dtype, grads[0].dtype, up.device, float(m.scale))
            groups.setdefault(key, []).append((m, up, down, *grads))
        for key, members in groups.items():
            _, ups, downs, d_ups, d_downs = zip(*members, strict=True)
            norms = batched_row_norms(ups, downs, d_ups, d_downs, key[-1]).to(key[2])
            first = len(self.rows)
            self.means.append(norms.mean(dim=1))
            for i, (m, _up, _down, *grads) in enumerate(members):
                self.norms[id(m)] = norms[i]
                self.stamps[id(m)] = tuple((weakref.ref(g), g._version) for g in grads)
                self.rows[id(m)] = first + i

    def stacked_means(self, loras: list[nn.Module]) -> Tensor | None:
        """What sd-scripts' `LoRANetwork.grad_norms()` returns for `loras` (each module's `grad_norms.mean(dim=0)`,
        stacked, for the modules that have grad_norms), from the batched computation: a cat and a gather instead of
        a mean per module (304 kernels per step on FLUX, launched one by one while the GPU waits). None where some
        module's grad_norms is not the latest batched result (set otherwise, or stale): the caller falls back."""
        with_norms = [m for m in loras if getattr(m, "grad_norms", None) is not None]
        if not with_norms or any(m.grad_norms is not self.norms.get(id(m)) for m in with_norms):
            return None
        rows = tuple(self.rows[id(m)] for m in with_norms)
        means = torch.cat(self.means) if len(self.means) > 1 else self.means[0]
        gather = self._gathers.get(rows)
        if gather is None or gather.device != means.device:
            gather = self._gathers[rows] = torch.tensor(rows, device=means.device)
        return means.index_select(0, gather)

    def update(self, m) -> None:
        """sd-scripts' LoRAModule.update_grad_norms, same semantics: skip when not training or without both
        gradients, else set `m.grad_norms` [out, 1] (no autograd history, as under sd-scripts' no_grad)."""
        grads = self._grads(m)
        if not m.training or grads is None:
            return
        if not self._fresh(m, grads):
            self._compute_all()
        m.grad_norms = self.norms[id(m)]


def wrapper_of(layer: nn.Module):
    """The object whose bound method replaced `layer.forward` (sd-scripts' LoRA module, whose `apply_to` does so),
    or None where the layer has its class's forward."""
    return getattr(layer.__dict__.get("forward"), "__self__", None)


def lora_modules(model: nn.Module) -> list[nn.Module]:
    """The LoRA modules applied to `model`'s layers, each once (a LoRA replaces its layer's `forward` with its own)."""
    found: dict[int, nn.Module] = {}
    for m in model.modules():
        wrapper = wrapper_of(m)
        if wrapper is not None and _is_lora(wrapper):
            found.setdefault(id(wrapper), wrapper)
    return list(found.values())


def install(model: nn.Module) -> tuple[int, int]:
    """Give each 2-D LoRA module on `model` the fast `update_grad_norms`, all sharing one `_Shared` (computed
    together); returns (patched, skipped)."""
    loras, skipped = [], 0
    for lora in lora_modules(model):
        if lora.lora_up.weight.dim() != 2 or lora.lora_down.weight.dim() != 2:
            skipped += 1  # conv LoRA: sd-scripts' own product does not apply to it either
            continue
        loras.append(lora)
    shared = _Shared(loras)
    for lora in loras:
        if ATTR not in lora.__dict__:
            lora.__dict__[ATTR] = lora.__dict__.get("update_grad_norms")
        lora.update_grad_norms = functools.partial(shared.update, lora)
    return len(loras), skipped


NETWORK_ATTR = "_flux_lora_norms_network"


def _shared_of(lora: nn.Module) -> _Shared | None:
    bound = getattr(lora.__dict__.get("update_grad_norms"), "func", None)
    return getattr(bound, "__self__", None) if isinstance(getattr(bound, "__self__", None), _Shared) else None


def _network_grad_norms(shared: _Shared, loras: list[nn.Module], original) -> Tensor | None:
    stacked = shared.stacked_means(loras)
    return original() if stacked is None else stacked


def install_network(network: nn.Module) -> bool:
    """Give a LoRA network object (sd-scripts' LoRANetwork: `text_encoder_loras`, `unet_loras`, `grad_norms()`,
    which sd-scripts calls every step to log `norm/avg_grad_norm`) a `grad_norms()` served from the batched norms
    of `install`. False where there is nothing to do: no such network, or none of its modules patched."""
    loras = _network_loras(network)
    shared = next((s for m in loras if (s := _shared_of(m)) is not None), None)
    original = getattr(network, "grad_norms", None)
    if shared is None or not callable(original) or NETWORK_ATTR in network.__dict__:
        return False
    network.__dict__[NETWORK_ATTR] = network.__dict__.get("grad_norms")
    network.grad_norms = functools.partial(_network_grad_norms, shared, loras, original)
    return True


def uninstall_network(network: nn.Module) -> bool:
    if NETWORK_ATTR not in network.__dict__:
        return False
    previous = network.__dict__.pop(NETWORK_ATTR)
    network.__dict__.pop("grad_norms", None)
    if previous is not None:
        network.grad_norms = previous
    return True


NORM_LOOPS = ("update_norms", "weight_norms", "combined_weight_norms")
LOOPS_ATTR = "_flux_lora_norms_loops"  # on the network: its own entries for NORM_LOOPS before install_norm_loops


def _network_loras(network: nn.Module) -> list[nn.Module]:
    return list(getattr(network, "text_encoder_loras", None) or []) + list(getattr(network, "unet_loras", None) or [])


def _has_ggpo(m: nn.Module) -> bool:
    return getattr(m, "ggpo_beta", None) is not None and getattr(m, "ggpo_sigma", None) is not None


def _update_norms(modules: list[nn.Module]) -> None:
    for m in modules:
        m.update_norms()


def _stacked_means(modules: list[nn.Module], attr: str) -> Tensor | None:
    means = [v.mean(dim=0) for m in modules if (v := getattr(m, attr, None)) is not None]
    return torch.stack(means) if means else None


def install_norm_loops(network: nn.Module) -> int | None:
    """sd-scripts' LoRANetwork calls `update_norms()`, `weight_norms()` and `combined_weight_norms()` on every step,
    each a Python loop over every LoRA module (FLUX: 304, ~3 ms a step on a slow host, one of them after the step's
    device sync, with the GPU idle), though only modules with GGPO (ggpo_beta and ggpo_sigma set) ever compute or
    hold those norms. Served by loops over those modules alone, in the network's order: none without GGPO. Returns
    how many modules have GGPO; None where nothing was done (no such network, or done already)."""
    loras = _network_loras(network)
    if not loras or LOOPS_ATTR in network.__dict__ or not all(callable(getattr(network, n, None)) for n in NORM_LOOPS):
        return None
    ggpo = [m for m in loras if _has_ggpo(m)]
    network.__dict__[LOOPS_ATTR] = {n: network.__dict__.get(n) for n in NORM_LOOPS}
    network.update_norms = functools.partial(_update_norms, ggpo)
    network.weight_norms = functools.partial(_stacked_means, ggpo, "weight_norms")
    network.combined_weight_norms = functools.partial(_stacked_means, ggpo, "combined_weight_norms")
    return len(ggpo)


def uninstall_norm_loops(network: nn.Module) -> bool:
    if LOOPS_ATTR not in network.__dict__:
        return False
    for name, previous in network.__dict__.pop(LOOPS_ATTR).items():
        network.__dict__.pop(name, None)
        if previous is not None:
            setattr(network, name, previous)
    return True


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
