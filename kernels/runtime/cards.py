"""Which kernels a card gets, from its description alone (capability, family): what a run there would try, each with
why or why not, without the card, a probe or a model. And what was verified on which cards.

On the card itself every kernel that applies is still probed against its reference before it is installed (the
registry's `select`), so a capability that promises more than the card's software delivers falls back with a line.
"""

from __future__ import annotations

from dataclasses import dataclass

from flux_kernels.patches.attention.backends import BACKENDS
from flux_kernels.patches.attention.probe import importable
from flux_kernels.runtime.device import DeviceInfo, as_device_info
from flux_kernels.runtime.request import parse_request

# Where the kernels were run against their references and timed (tests/gpu, flux-train bench): the lent machines.
VERIFIED_ON = {"hopper": "H100 / H200 (sm_90): GPU tests against each reference, forward and backward, and benches"}


@dataclass(frozen=True)
class Choice:
    name: str
    applies: bool
    reason: str


def kernels_on(device, request: str = "auto") -> list[Choice]:
    """Each kernel the request names (`auto`: auto's own) and whether it applies on `device` (a DeviceInfo or its
    fields as a dict), by the registry's `applies` alone."""
    from flux_kernels.runtime.registry import REGISTRY

    info = as_device_info(device)
    wanted = parse_request(request)
    out = []
    for name, spec in REGISTRY.items():
        if not wanted.wants(name, in_auto=spec.in_auto):
            continue
        ok, why = spec.applies(info)
        out.append(Choice(name, ok, why))
    return out


def attention_on(device) -> list[Choice]:
    """Each trainable attention backend and whether the card can run it: CUDA, the capability it needs; a package it
    needs is named where it is not installed here (on the card's own machine it may be)."""
    info = as_device_info(device)
    out = []
    for b in BACKENDS.values():
        if not b.trainable or b.name == "sdpa_math":  # the reference, never chosen for speed
            continue
        if b.cuda_only and info.type != "cuda":
            out.append(Choice(b.name, False, f"needs CUDA (device is {info.type})"))
        elif b.min_capability and (info.capability is None or tuple(info.capability) < b.min_capability):
            need = "sm_{}{}".format(*b.min_capability)
            out.append(Choice(b.name, False, f"needs {need} or newer (the card is {_sm(info)})"))
        elif b.requires and not importable(b.requires):
            out.append(Choice(b.name, True, f"the card runs it; needs `{b.install or b.requires}` installed"))
        else:
            out.append(Choice(b.name, True, b.note or "PyTorch's"))
    return out


def verified(device) -> str:
    """What was verified on this card's family, in one sentence."""
    info = as_device_info(device)
    if info.family in VERIFIED_ON:
        return f"verified on {VERIFIED_ON[info.family]}"
    measured = ", ".join(VERIFIED_ON.values())
    return (
        f"chosen by capability ({_sm(info)}, {info.family}); not run here: each kernel is probed against its "
        f"reference at the run's start on the card, and falls back where it differs (verified on {measured})"
    )


def summary(device, request: str = "auto", only: tuple[str, ...] | None = None) -> str:
    """One line: the kernels a run on the card would install, those it would not and why, the attention backends
    it can run, and what was verified where. `only`: the kernels the run's trainer takes (the others patch a model it
    does not build, so they are left out of the line, and so are the attention backends where `attention` is not
    among them)."""
    info = as_device_info(device)
    kernels = [c for c in kernels_on(info, request) if only is None or c.name in only]
    yes = ", ".join(c.name for c in kernels if c.applies) or "none"
    no = "; ".join(f"{c.name} ({c.reason})" for c in kernels if not c.applies)
    attention = ", ".join(c.name + (" (not installed here)" if "installed" in c.reason else "")
                          for c in attention_on(info) if c.applies)  # fmt: skip
    backends = f"; attention backends it can run: {attention or 'none'}" if only is None or "attention" in only else ""
    head = f"kernels on {info.name} ({_sm(info)}): {yes}" + (f"; not: {no}" if no else "")
    return f"{head}{backends}; {verified(info)}"


def _sm(info: DeviceInfo) -> str:
    return f"sm_{info.capability[0]}{info.capability[1]}" if info.capability else info.type
