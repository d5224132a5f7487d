"""What our trainer subclass does at sd-scripts' hook points: kernels after the model loads, metrics per step.

Kept apart from runner.py so the hook logic is testable without building a trainer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("flux_trainer.runner")


class RunHooks:
    def __init__(self, spec: Any, run_dir: Path) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.metrics = None
        self.kernels_installed: list[str] = []
        self._flux = None

    # model loaded: remember the transformer; kernels go in once the LoRA is applied (before_prepare)
    def model_loaded(self, flux: Any, accelerator: Any) -> None:
        self._flux = flux

    def before_prepare(self, unet: Any, args: Any, accelerator: Any) -> None:
        self.kernels_installed = install_kernels(unet, self.spec.kernels, accelerator.device)
        if self.spec.metrics.get("enabled", True):
            self.metrics = make_step_metrics(unet, args, accelerator, self.spec.metrics)

    def step_start(self) -> None:
        if self.metrics is not None:
            self.metrics.mark_data_ready()

    def step_end(self, accelerator: Any, logs: dict, global_step: int) -> dict[str, float]:
        if self.metrics is None:
            return {}
        return self.metrics.on_step_end(global_step)


def install_kernels(unet: Any, kernels: dict[str, Any], device: Any) -> list[str]:
    """Install the configured kernel set into sd-scripts' Flux model; returns what was installed."""
    if kernels.get("set", "off") == "off":
        log.info("kernels: off (plain sd-scripts compute path)")
        return []
    try:
        from flux_kernels import patch, registry
    except ImportError as exc:  # pragma: no cover - flux_kernels ships with flux-train
        log.warning("kernels: flux_kernels unavailable (%s); plain sd-scripts compute path", exc)
        return []
    selection = registry.select(kernels.get("set", "auto"), device)
    installed = patch.apply_kernels(unet, selection)
    log.info("kernels installed: %s", ", ".join(installed) or "none")
    return installed


def make_step_metrics(unet: Any, args: Any, accelerator: Any, options: dict[str, Any]) -> Any:
    from flux_trainer.metrics.step import StepMetrics

    return StepMetrics(
        device=accelerator.device,
        flops_per_step=options.get("flops_per_step"),
        images_per_step=options.get("images_per_step", 1),
        peak_tflops=options.get("peak_tflops"),
    )
