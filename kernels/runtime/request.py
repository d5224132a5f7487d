"""What a kernel set asks for (`kernels.set`), parsed without importing torch, so a configuration can be checked
before anything loads.

    auto                  every kernel marked `in_auto` that applies here and passes its probe (the default)
    off                   none
    a,b                   exactly these; one that cannot run is an error naming why
    auto,a,-b             auto's kernels plus `a` (insisted on: an error if it cannot run) without `b`
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# every kernel of the registry (flux_kernels.runtime.registry.REGISTRY, which checks that it holds exactly these, in
# this order): the launcher checks a configuration's names against it without importing torch and the kernels
KERNEL_NAMES = (
    "chroma_blocks",
    "attention",
    "qk_norm_rope",
    "modulate",
    "gated_residual",
    "gated_modulate",
    "single_qkv",
    "double_qkv",
    "fp8_matmul",
    "lora_fold",
    "flux_prologue",
    "lora_grad_norms",
    "prodigy_step",
    "adamw_step",
    "single_process_reduce",
    "coalesced_reduce",
    "selective_checkpoint",
    "compile_blocks",
    "activation_offload",
    "block_swap",
)


@dataclass(frozen=True)
class KernelRequest:
    auto: bool  # start from auto's kernels (each skipped with a log line where it cannot run)
    named: tuple[str, ...] = ()  # asked for by name: failing to install one is an error, not a fallback
    removed: tuple[str, ...] = ()  # taken out of auto's kernels

    def wants(self, name: str, in_auto: bool) -> bool:
        """Whether a kernel with this name (in auto's set or not) is a candidate."""
        return name in self.named or (self.auto and in_auto and name not in self.removed)


def parse_request(requested: str | Iterable[str] | None, known: Iterable[str] | None = None) -> KernelRequest:
    """`requested` as a KernelRequest: None or "auto" is auto, "off" / "none" / "" nothing, otherwise a comma list
    (or a list) of names, `auto`, and `-name` to take one out of auto. With `known`, an unknown name is a
    ValueError naming the choices; `-name` without `auto`, or a name both added and removed, is one too."""
    if requested is None:
        return KernelRequest(auto=True)
    if isinstance(requested, str):
        word = requested.strip().lower()
        if word in ("off", "none", ""):
            return KernelRequest(auto=False)
        requested = requested.replace(" ", "").split(",")
    words = [w.strip() for w in requested if w and w.strip()]
    auto = any(w.lower() == "auto" for w in words)
    named = tuple(dict.fromkeys(w for w in words if w.lower() != "auto" and not w.startswith("-")))
    removed = tuple(dict.fromkeys(w[1:] for w in words if w.startswith("-")))
    if known is not None:
        known = list(known)
        unknown = [n for n in (*named, *removed) if n not in known]
        if unknown:
            raise ValueError(
                f"unknown kernel {', '.join(map(repr, unknown))}; choose from {', '.join(known)}, or auto / off "
                "(auto,name adds one to auto, auto,-name takes one out)"
            )
    if removed and not auto:
        raise ValueError(f"-{removed[0]} takes a kernel out of auto: write auto,-{removed[0]}")
    both = [n for n in named if n in removed]
    if both:
        raise ValueError(f"kernel {both[0]!r} is both added and taken out")
    return KernelRequest(auto=auto, named=named, removed=removed)
