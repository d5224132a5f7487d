"""Training metrics: FLOPs and MFU, per-step scalars, loss and slowdown watchdogs, TensorBoard text/HParams/readers.

Names are resolved lazily, so ``flux-train runs`` (which only reads event files) does not pay for importing
torch, and importing this package does nothing else (no CUDA, no NVML) until something is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "flops": (
        "StepFlops",
        "PeakTflops",
        "PEAK_BF16_TFLOPS",
        "flux_step_flops",
        "img_tokens_for",
        "mfu",
        "peak_bf16_tflops",
    ),
    "step": ("StepMetrics", "reduce_max_across_ranks"),
    "health": ("LossGuard", "SlowdownDetector"),
    "nvml": ("NvmlReader",),
    "tensorboard": (
        "RunSummary",
        "flatten_config",
        "list_runs",
        "read_hparams",
        "read_scalars",
        "read_texts",
        "summarize_run",
        "write_hparams",
        "write_run_text",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'flux_trainer.metrics' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
