"""Installing flux_kernels on what sd-scripts built: the model (before accelerate prepares it), the optimizer and
the trainer. Each kernel the registry verifies here first; one that fails its check is named and left out."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("flux_trainer.runner")
CUDA_GRAPHS_OPTIONS = {"triton.cudagraphs": True}  # what torch.compile's mode="reduce-overhead" sets


def install_kernels(unet: Any, kernels: dict[str, Any], device: Any) -> list[str]:
    """Install the configured kernel set into sd-scripts' Flux model; returns what was installed."""
    if kernels.get("set", "off") == "off":
        log.info("kernels: off (plain sd-scripts compute path)")
        return []
    from flux_kernels.patches import patch
    from flux_kernels.runtime import registry
    from flux_kernels.runtime.errors import KernelError
    from flux_trainer.config.paths import cache_root

    selection = registry.select(kernels.get("set", "auto"), device, model=unet)
    options = {
        "attention": {"cache_path": cache_root() / "kernels" / "attention_probe.json"},
        "fp8_matmul": {"keep_transposed": bool(kernels.get("fp8_keep_transposed"))},
    }
    graphs = bool(kernels.get("cuda_graphs")) and "compile_blocks" in selection.installed
    moved = _swap_moves_weights(unet, selection)
    if kernels.get("cuda_graphs") and (not graphs or moved):
        compiled = selection.skipped.get("compile_blocks", "not selected")
        why = moved or f"compile_blocks is not installed here ({compiled})"
        graphs = False
        if kernels.get("cuda_graphs_asked"):
            raise KernelError(f"kernels.cuda_graphs=true replays the compiled blocks, but {why}")
        log.info("cuda graphs skipped: %s", why)
    inductor = {**CUDA_GRAPHS_OPTIONS} if graphs else {}
    if inductor:
        options["compile_blocks"] = {"options": inductor}
    offload = {"graphs": True} if graphs else {}  # its copies must not race the replays
    if offload:
        options["activation_offload"] = offload
    seconds: dict[str, float] = {}
    installed = patch.apply_kernels(unet, selection, options=options, seconds=seconds)
    log.info("kernels: probes %s; installing %s", selection.probe_time(), registry.seconds_by_name(seconds))
    if graphs and "compile_blocks" in installed:
        if getattr(unet, "blocks_to_swap", None) and "block_swap" not in installed:
            raise KernelError("kernels.cuda_graphs: the compiled blocks were set to replay from graphs over swapped "
                              "blocks, but block_swap did not install: sd-scripts' own swap moves the weights they "
                              "read")  # fmt: skip
        installed.append("cuda_graphs")
    return installed


def _swap_moves_weights(unet: Any, selection: Any) -> str | None:
    """Why CUDA graphs cannot replay this model's blocks because of block swap, or None. A graph reads each weight at
    the address it was recorded with: flux_kernels' block_swap copies a swapped block into the same card buffers at
    every use, sd-scripts' own swap (where block_swap is not installed) moves the tensors."""
    if not getattr(unet, "blocks_to_swap", None) or "block_swap" in selection.installed:
        return None
    why = selection.skipped.get("block_swap", "not selected")
    return f"the model swaps blocks without the block_swap kernel ({why}): sd-scripts' swap moves the weights"


def install_optimizer_kernels(optimizer: Any, kernels: dict[str, Any]) -> list[str]:
    """The kernels whose target is sd-scripts' optimizer (prodigy_step, adamw_step), probed on this process's
    device. One that is named but cannot run (another optimizer, a failed probe) is an error; under auto, a log
    line."""
    return _install_on(optimizer, "optimizer", kernels, "change the optimizer")


def install_trainer_kernels(trainer: Any, kernels: dict[str, Any]) -> list[str]:
    """The kernels whose target is our FluxNetworkTrainer subclass (single_process_reduce, coalesced_reduce), as
    above."""
    return _install_on(trainer, "trainer", kernels, "use auto")


def _install_on(target: Any, kind: str, kernels: dict[str, Any], instead: str) -> list[str]:
    if kernels.get("set", "off") == "off":
        return []
    import torch

    from flux_kernels.runtime import registry
    from flux_kernels.runtime.errors import KernelError

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    selection = registry.select(kernels.get("set", "auto"), device, target=kind)
    installed = []
    for spec in selection.specs:
        try:
            line = spec.install(target)
        except ValueError as e:
            if selection.insists(spec.name):
                raise KernelError(f"{e}; remove {spec.name} from kernels= or {instead}") from e
            log.info("kernel %s skipped: %s", spec.name, str(e).removeprefix(f"{spec.name}: "))
            continue
        log.info("flux_kernels installed %s", line)
        installed.append(spec.name)
    return installed


# torch.compile's mode="reduce-overhead" (cudagraph trees) as inductor options, which other options can join
