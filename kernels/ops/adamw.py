"""AdamW's optimizer step in torch's fused form (`adamw_step`): the step sd-scripts builds for
`optimizer_type = "AdamW"` (`torch.optim.AdamW(params, lr, **optimizer_args)`, neither `fused` nor `foreach` given).

Built that way on a GPU, AdamW takes torch's multi-tensor path: about ten `_foreach_*` passes over the parameters and
their moments, and, since its step counts live on the host, two Python reads of each parameter's count per step for
the bias corrections (a FLUX LoRA has 608 tensors: ~1.2k `item()` calls, each a little CPU time spent while the
device waits at the end of the step). The fused form is one kernel per device and dtype that reads each parameter,
gradient and moment once, with its step counts on the device. Same algorithm, same hyperparameters, same state keys;
rounding order only (the install probe compares it with the multi-tensor step over several steps).

`install` leaves the optimizer's class alone and adds two hooks: a step pre-hook that puts each group on the fused
path (`fused=True`, `foreach=False`, its step counts moved to the parameter's device as fused expects) before a
step, so a state loaded from a checkpoint (which brings its group settings with it) is fused again at the next
step; and a state_dict post-hook that saves the state as the optimizer sd-scripts built would (step counts as host
scalars, the groups' `fused` / `foreach` as built), so a saved state resumes the same with or without this kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flux_kernels.ops.reference import optimizer_probe

ATTR = "_flux_fused_adamw"  # on the optimizer: the hook handles install() added


def _fused_devices() -> tuple[str, ...]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


def problem(optimizer) -> str | None:
    """Why the fused step cannot stand in for this optimizer's (None: it can)."""
    cls = type(optimizer)
    if cls not in (torch.optim.AdamW, torch.optim.Adam):
        return f"the optimizer is {cls.__module__}.{cls.__name__}, not torch.optim.AdamW"
    groups = optimizer.param_groups
    if any(g.get("differentiable") for g in groups):
        return "differentiable=True has no fused form"
    if all(g.get("fused") for g in groups):
        return "it is fused already (optimizer_args fused=True)"
    devices = _fused_devices()
    for g in groups:
        for p in g["params"]:
            if p.device.type not in devices or not torch.is_floating_point(p):
                return f"a {p.dtype} parameter on {p.device.type} (fused AdamW: floating point on {', '.join(devices)})"
    return None


def _to_fused(optimizer, args, kwargs) -> None:
    """Step pre-hook: every group on the fused path, its step counts on its parameters' device (float32). A group
    already fused has them there (torch's load_state_dict moves a fused group's counts to its parameters)."""
    for group in optimizer.param_groups:
        if group["fused"] is True:
            continue
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)


def _set_groups(groups: list[dict], settings: list[tuple]) -> None:
    """Each group's `fused` / `foreach` as recorded at install."""
    for group, (fused, foreach) in zip(groups, settings, strict=False):
        group["fused"], group["foreach"] = fused, foreach


def _as_built(settings: list[tuple]):
    """A state_dict post-hook: the state as the optimizer sd-scripts built would save it, step counts as host float32
    scalars and each group's `fused` / `foreach` as they were before install, so a state saved here resumes the same
    with or without this kernel."""

    def hook(optimizer, state_dict: dict) -> dict:
        for key, entry in state_dict["state"].items():  # each entry is the live state's dict: replaced, not changed
            if isinstance(step := entry.get("step"), Tensor):
                state_dict["state"][key] = {**entry, "step": step.detach().to("cpu", torch.float32, copy=True)}
        _set_groups(state_dict["param_groups"], settings)
        return state_dict

    return hook


def install(optimizer) -> str:
    """Put `optimizer` (torch AdamW/Adam, not fused) on the fused step from its next step on."""
    if (why := problem(optimizer)) is not None:
        raise ValueError(f"adamw_step: {why}")
    if getattr(optimizer, ATTR, None) is None:
        settings = [(g["fused"], g["foreach"]) for g in optimizer.param_groups]
        hooks = (
            optimizer.register_step_pre_hook(_to_fused),
            optimizer.register_state_dict_post_hook(_as_built(settings)),
        )
        setattr(optimizer, ATTR, (hooks, settings))
    n = sum(len(g["params"]) for g in optimizer.param_groups)
    return f"adamw_step: {n} tensors in {len(optimizer.param_groups)} group(s), fused (one kernel per device and dtype)"


def uninstall(optimizer) -> bool:
    """Remove the hooks; the groups get their settings as built back (the step counts stay where the fused step left
    them, which the multi-tensor step reads too, one host read each)."""
    installed = optimizer.__dict__.pop(ATTR, None)
    if installed is None:
        return False
    hooks, settings = installed
    for handle in hooks:
        handle.remove()
    _set_groups(optimizer.param_groups, settings)
    return True


def self_check(device: torch.device, steps: int = 6, rel: float = 1e-5) -> tuple[bool, str]:
    """The install probe: torch's own AdamW step as sd-scripts builds it (multi-tensor on a GPU) and the fused step
    on the same tiny random float32 parameters and gradients, on `device`, `steps` steps; the parameters must agree
    within `rel`."""
    if torch.device(device).type not in _fused_devices():
        return False, f"torch {torch.__version__} has no fused AdamW on {torch.device(device).type}"
    worst, (_, fused) = optimizer_probe(
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01), install, device, steps
    )
    if not all(g["fused"] is True and not g["foreach"] for g in fused.param_groups):
        return False, "the fused step did not run (the groups are not set to fused)"
    if not worst <= rel:
        return False, f"fused AdamW differs from torch's default step after {steps} steps ({worst:.2e} > {rel:.0e})"
    return True, f"matches torch's default AdamW step over {steps} steps (max rel. error {worst:.1e})"
