"""Prodigy's optimizer step without a host sync per parameter (prodigyopt 1.1, the optimizer sd-scripts builds for
`optimizer_type = "Prodigy"`).

prodigyopt's `step` walks the parameters one by one and reads two numbers back to the host for each
(`dot(...).item()` and `s.abs().sum().item()`): on a FLUX LoRA (608 tensors: 304 modules, down and up) that is
~1.2k device syncs and ~8k small kernels per optimizer step, each sync leaving the GPU idle while Python launches
the next kernel. `fast_step` does the same arithmetic with PyTorch's multi-tensor (`_foreach_*`) ops and, for the
numerator's dot products, a few flattened chunks of tensors; it keeps the two sums on the device and reads them
back once: one sync per step. The state it keeps is prodigyopt's, key for key (a run saved with one resumes with
the other), and the Python-side values sd-scripts logs (`d`, `d_hat`, ...) stay Python floats.

Where it differs: the numerator's dot products run over chunks of tensors instead of one tensor at a time and are
added on the device in float64 instead of on the host, and |s| is summed by `_foreach_norm(ord=1)` instead of
`abs().sum()`: rounding order only (tests and the install probe compare it with prodigyopt over several steps).
Configurations it does not cover (`slice_p` > 1, FSDP, lr 0) run prodigyopt's own step.
"""

from __future__ import annotations

import contextlib
import io
import math
import os

import torch
from torch import Tensor

from flux_kernels.ops.reference import optimizer_probe

ATTR = "_flux_fast_prodigy"  # set on the subclass install() swaps in; its value is the original class


def _plain_class(optimizer) -> type:
    cls = type(optimizer)
    return getattr(cls, ATTR, cls)


def problem(optimizer) -> str | None:
    """Why fast_step cannot stand in for this optimizer's step (None: it can)."""
    cls = _plain_class(optimizer)
    if cls.__name__ != "Prodigy" or not cls.__module__.startswith("prodigyopt"):
        return f"the optimizer is {cls.__module__}.{cls.__name__}, not prodigyopt's Prodigy"
    keys = ("d", "d0", "d_max", "d_coef", "d_numerator", "betas", "beta3", "k", "growth_rate", "slice_p", "eps")
    missing = [k for k in keys if k not in optimizer.param_groups[0]]
    if missing:
        return f"this prodigyopt Prodigy has no {', '.join(missing)} (a version fast_step does not know)"
    return None


def _falls_back(optimizer) -> bool:
    """Settings prodigyopt's own step handles and fast_step leaves to it."""
    groups = optimizer.param_groups
    if any(g.get("slice_p", 1) != 1 or g.get("fsdp_in_use") for g in groups):
        return True
    if max(g["lr"] for g in groups) <= 0.0:
        return True
    return any(hasattr(p, "_fsdp_flattened") for g in groups for p in g["params"])


def _init_state(optimizer, params: list[Tensor], beta1: float) -> None:
    """prodigyopt's state for parameters seen for the first time (p0: a copy, or a zero scalar for an all-zero
    tensor such as LoRA's zero-initialised up weights); one host read for all of them."""
    new = [p for p in params if "step" not in optimizer.state[p]]
    if not new:
        return
    nonzero = torch.stack([p.any() for p in new]).tolist()
    for p, any_nonzero in zip(new, nonzero, strict=True):
        state = optimizer.state[p]
        state["step"] = 0
        state["s"] = torch.zeros_like(p.data.flatten()).detach()
        if any_nonzero:
            state["p0"] = p.flatten().detach().clone()
        else:
            state["p0"] = torch.tensor(0, device=p.device, dtype=p.dtype)
        if beta1 > 0:
            state["exp_avg"] = torch.zeros_like(p.data).detach()
        state["exp_avg_sq"] = torch.zeros_like(p.data).detach()


CHUNK = 1 << 24  # elements per chunk of the numerator's flattened vectors (64 MiB of float32 each)


def _chunks(params: list[Tensor], budget: int) -> list[list[int]]:
    """The parameters' indices in order, cut into runs of at most `budget` elements (a larger tensor alone)."""
    chunks, size = [[]], 0
    for i, p in enumerate(params):
        if chunks[-1] and size + p.numel() > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += p.numel()
    return chunks


def _numerator(flat_grads: list[Tensor], states: list[dict], params: list[Tensor]) -> Tensor:
    """The sum over tensors of dot(grad, p0 - p), in float64 on the device: each chunk of tensors flattened into one
    vector and multiplied in one dot (prodigyopt: a subtraction and a dot for every tensor, ~1.2k kernels per step on
    a FLUX LoRA; a dot per tensor here was most of this step's GPU time). A zero-initialised tensor's p0 is a scalar
    in prodigyopt's state, spread over the tensor here."""
    total = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for chunk in _chunks(params, CHUNK):
        grad = torch.cat([flat_grads[i] for i in chunk])
        diff = torch.cat([states[i]["p0"].flatten().expand(params[i].numel()) for i in chunk])
        diff.sub_(torch.cat([params[i].flatten() for i in chunk]))
        total += torch.dot(grad, diff.to(grad.dtype)).double()
    return total


# the flat path where it applies; FLUX_KERNELS_PRODIGY_FLAT=0 keeps the multi-tensor ops everywhere (to compare them)
FLAT = os.environ.get("FLUX_KERNELS_PRODIGY_FLAT", "1") != "0"


def _flat_eligible(params: list[Tensor]) -> bool:
    first = params[0]
    return all(p.device == first.device and p.dtype == first.dtype and p.is_contiguous() for p in params)


class _Flat:
    """One parameter group's Prodigy state in four flat buffers (exp_avg, exp_avg_sq, s, p0), each parameter's state
    tensor a view into them, so that the step runs a few ops over whole buffers. prodigyopt's state is kept as it is,
    key for key and shape for shape (a zero-initialised tensor's p0 stays its scalar zero, spread over the tensor's
    slice of the p0 buffer here): saved and loaded like prodigyopt's, and a state loaded from a file (no longer views
    of these buffers) is copied in again at the next step (`current`)."""

    def __init__(self, optimizer, params: list[Tensor], beta1: float) -> None:
        self.params = list(params)
        self.sizes = [p.numel() for p in params]
        self.state, self.states = optimizer.state, [optimizer.state[p] for p in params]
        n, like = sum(self.sizes), params[0]
        self.exp_avg = like.new_zeros(n) if beta1 > 0 else None
        self.exp_avg_sq, self.s, self.p0 = like.new_zeros(n), like.new_zeros(n), like.new_empty(n)
        off = 0
        for p, size in zip(params, self.sizes, strict=True):
            state, part = optimizer.state[p], slice(off, off + size)
            for key, buf in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq), ("s", self.s)):
                if buf is not None:
                    buf[part].copy_(state[key].flatten())
                    state[key] = buf[part].view_as(state[key])
            if state["p0"].dim() == 0:
                self.p0[part].fill_(state["p0"])
            else:
                self.p0[part].copy_(state["p0"].flatten())
                state["p0"] = self.p0[part]
            off += size

    def current(self, optimizer, params: list[Tensor]) -> bool:
        """Still this group's parameters with the state built from (load_state_dict replaces the optimizer's whole
        `state`, with tensors that are not these buffers' views). Checked every step, so kept to identity tests:
        this step is CPU-bound on a FLUX LoRA's 608 tensors (its kernels ~3 ms of GPU time on an H200)."""
        return (
            optimizer.state is self.state
            and len(params) == len(self.params)
            and all(a is b for a, b in zip(params, self.params, strict=True))
        )

    def chunks(self):
        n = self.s.numel()
        return [slice(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)]

    def numerator(self, grad: Tensor, param: Tensor) -> Tensor:
        """sum(grad * (p0 - p)) in float64, one dot per CHUNK of the flat vectors (the temporary is a chunk)."""
        total = torch.zeros((), dtype=torch.float64, device=grad.device)
        for c in self.chunks():
            total += torch.dot(grad[c], self.p0[c] - param[c]).double()
        return total

    def denominator(self) -> Tensor:
        return torch.stack([torch.linalg.vector_norm(self.s[c], 1) for c in self.chunks()]).double().sum()

    def update(self, param: Tensor, grad: Tensor, **step) -> None:
        """`_descend` on the flat vectors chunk by chunk (its temporary is a chunk), then each parameter tensor gets
        its slice."""
        for c in self.chunks():
            exp_avg = [self.exp_avg[c]] if self.exp_avg is not None else None
            _descend([param[c]], exp_avg, [self.exp_avg_sq[c]], [grad[c]], **step)
        torch._foreach_copy_(self.params, torch._C._nn.unflatten_dense_tensors(param, self.params))

    def gather(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The gradients and the parameters as flat vectors (flattened and concatenated in C++, one call each)."""
        return torch._C._nn.flatten_dense_tensors(grads), torch._C._nn.flatten_dense_tensors(self.params)


def _flat(optimizer, index: int, params: list[Tensor], beta1: float) -> _Flat | None:
    """Group `index`'s flat state when every parameter of the group has a gradient (else None: the multi-tensor
    path steps the ones that have, as prodigyopt does), built or rebuilt as needed. Kept on the optimizer object,
    not in its param groups, which state_dict() would save."""
    if not FLAT or len(params) != len(optimizer.param_groups[index]["params"]):
        return None
    flats = optimizer.__dict__.setdefault("_flux_flat", {})
    flat = flats.get(index)
    if flat is None or not flat.current(optimizer, params):
        if not _flat_eligible(params):
            return None
        _init_state(optimizer, params, beta1)
        flat = flats[index] = _Flat(optimizer, params, beta1)
    return flat


def _moments(exp_avgs, exp_avg_sqs, ss, grads, flat_grads, *, beta1, beta2, beta3, d, rate) -> None:
    """prodigyopt's moment and `s` updates over lists of tensors (the flat path passes one buffer each)."""
    if beta1 > 0:
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=d * (1 - beta1))
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=d * d * (1 - beta2))
    torch._foreach_mul_(ss, beta3)
    torch._foreach_add_(ss, flat_grads, alpha=rate)


def _descend(params, exp_avgs, exp_avg_sqs, grads, *, group, d, dlr, beta1) -> None:
    """prodigyopt's parameter update over lists of tensors: decoupled weight decay, then
    p -= dlr * exp_avg / (sqrt(exp_avg_sq) + d * eps) (grad * d without a first moment)."""
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, d * group["eps"])
    if group["weight_decay"] != 0 and group["decouple"]:
        torch._foreach_add_(params, params, alpha=-group["weight_decay"] * dlr)
    if beta1 > 0:
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-dlr)
    else:
        torch._foreach_addcdiv_(params, grads, denom, value=-dlr * d)


@torch.no_grad()
def fast_step(self, closure=None):
    """One Prodigy step for every parameter with a gradient: prodigyopt's arithmetic, multi-tensor, one sync."""
    if _falls_back(self):
        plain = _plain_class(self).step
        return getattr(plain, "__wrapped__", plain)(self, closure)  # not its step hooks a second time
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()

    first = self.param_groups[0]
    beta1, beta2 = first["betas"]
    beta3 = first["beta3"] if first["beta3"] is not None else math.sqrt(beta2)
    k, d, d_max, d_coef = first["k"], first["d"], first["d_max"], first["d_coef"]
    lr = max(g["lr"] for g in self.param_groups)
    bias = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if first["use_bias_correction"] else 1
    dlr = d * lr * bias
    d_numerator = first["d_numerator"] * beta3

    betas = {"beta1": beta1, "beta2": beta2, "beta3": beta3}

    def rate(group) -> float:  # how much of the gradient goes into s
        return (d / group["d0"]) * (d if group["safeguard_warmup"] else dlr)

    numerators, denominators, stepped = [], [], []
    for index, group in enumerate(self.param_groups):
        if group["lr"] not in (lr, 0.0):
            raise RuntimeError(
                "Setting different lr values in different parameter groups is only supported for values of 0"
            )
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        grads = [p.grad for p in params]
        if group["weight_decay"] != 0 and not group["decouple"]:
            torch._foreach_add_(grads, params, alpha=group["weight_decay"])
        flat = _flat(self, index, params, beta1) if group["lr"] > 0.0 else None
        if flat is not None:
            grad, param = flat.gather(grads)
            stepped.append((group, params, grads, (flat, grad, param)))
            numerators.append(flat.numerator(grad, param) * ((d / group["d0"]) * dlr))
            exp_avgs = [flat.exp_avg] if beta1 > 0 else None
            _moments(exp_avgs, [flat.exp_avg_sq], [flat.s], [grad], [grad], d=d, rate=rate(group), **betas)
            denominators.append(flat.denominator())
            continue
        _init_state(self, params, beta1)
        stepped.append((group, params, grads, None))
        if group["lr"] <= 0.0:
            continue
        states = [self.state[p] for p in params]
        flat = [g.flatten() for g in grads]
        numerators.append(_numerator(flat, states, params) * ((d / group["d0"]) * dlr))
        exp_avgs = [s["exp_avg"] for s in states] if beta1 > 0 else None
        ss = [s["s"] for s in states]
        _moments(exp_avgs, [s["exp_avg_sq"] for s in states], ss, grads, flat, d=d, rate=rate(group), **betas)
        denominators.append(torch.stack(torch._foreach_norm(ss, 1)).double().sum())

    if not denominators:
        return loss
    zero = torch.zeros((), dtype=torch.float64, device=denominators[0].device)
    delta_numerator, d_denom = torch.stack([sum(numerators, zero), sum(denominators, zero)]).tolist()  # the sync
    if d_denom == 0:
        return loss  # no progress possible (all gradients zero): prodigyopt leaves everything as it was
    global_d_numerator = d_numerator + delta_numerator
    d_hat = d_coef * global_d_numerator / d_denom
    if d == first["d0"]:
        d = max(d, d_hat)
    d_max = max(d_max, d_hat)
    d = min(d_max, d * first["growth_rate"])

    for group in self.param_groups:
        group.update(d_numerator=global_d_numerator, d_denom=d_denom, d=d, d_max=d_max, d_hat=d_hat)
    for group, params, grads, flat in stepped:
        states = flat[0].states if flat is not None else [self.state[p] for p in params]
        for s in states:
            s["step"] += 1
        step = {"group": group, "d": d, "dlr": dlr, "beta1": beta1}
        if flat is not None:
            flat, grad, param = flat
            flat.update(param, grad, **step)
            continue
        exp_avgs = [s["exp_avg"] for s in states] if beta1 > 0 else None
        _descend(params, exp_avgs, [s["exp_avg_sq"] for s in states], grads, **step)
    for group in self.param_groups:
        group["k"] = group["k"] + 1
    return loss


def install(optimizer) -> str:
    """Swap `optimizer`'s class for a subclass whose step is fast_step (isinstance checks, state_dict and
    sd-scripts' reading of `d` are unchanged). Install before an LR scheduler wraps the step."""
    if (why := problem(optimizer)) is not None:
        raise ValueError(f"prodigy_step: {why}")
    cls = _plain_class(optimizer)
    fast = type(f"Fast{cls.__name__}", (cls,), {"step": fast_step, ATTR: cls})
    optimizer.__class__ = fast
    if hasattr(optimizer, "_patch_step_function"):
        optimizer._patch_step_function()  # the step hooks torch.optim.Optimizer puts on every optimizer class
    n = sum(len(g["params"]) for g in optimizer.param_groups)
    return f"prodigy_step: {n} tensors in {len(optimizer.param_groups)} group(s), one device sync per step"


def uninstall(optimizer) -> bool:
    cls = getattr(type(optimizer), ATTR, None)
    if cls is None:
        return False
    optimizer.__class__ = cls
    return True


def self_check(device: torch.device, steps: int = 6, rel: float = 1e-4) -> tuple[bool, str]:
    """The install probe: prodigyopt's own step and fast_step on the same tiny random parameters (one all-zero)
    and gradients, on `device`, `steps` steps; the parameters must agree within `rel` of each tensor's scale."""
    try:
        from prodigyopt import Prodigy
    except ImportError:
        return False, "prodigyopt is not installed (sd-scripts needs it for optimizer_type Prodigy)"

    def build(params):
        with contextlib.redirect_stdout(io.StringIO()):  # prodigyopt prints its settings; keep a --json doctor clean
            return Prodigy(params, lr=1.0, weight_decay=0.01, decouple=True, use_bias_correction=True)

    worst, _ = optimizer_probe(build, install, device, steps)
    if not worst <= rel:
        return False, f"fast_step differs from prodigyopt after {steps} steps (max rel. error {worst:.2e} > {rel:.0e})"
    return True, f"matches prodigyopt over {steps} steps (max rel. error {worst:.1e})"
