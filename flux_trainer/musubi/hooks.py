"""What our trainer subclass does at musubi-tuner's hook points: our TensorBoard tags every step, the terminal's
progress line, the run's texts once. Kept apart from runner.py so it is testable without a trainer.

musubi-tuner's NetworkTrainer offers extension seams: `on_train_start` (models prepared, loop about to start),
`process_batch` (a batch arrived), `on_post_optimizer_step` (after each optimizer step, with the step number before
its increment) and `extra_step_logs` (the dict merged into what it hands accelerator.log on a logging step). The
step's tags are measured at `on_post_optimizer_step` and handed over at `extra_step_logs`, so they land in the same
TensorBoard run and step as its own loss/* and lr/* tags (flux_trainer.metrics, as for sd-scripts).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flux_trainer.metrics import progress

log = logging.getLogger("flux_trainer.musubi.runner")
RUN_TEXT_FILES = {"config": "config.yaml", "command": "command.txt", "environment": "env.json"}


class MusubiHooks:
    def __init__(self, options: dict[str, Any], run_dir: Path, max_steps: int | None) -> None:
        self.options = options  # RunnerSpec.metrics
        self.run_dir = Path(run_dir)
        self.max_steps = max_steps
        self.metrics: Any = None
        self._pending: dict[str, float] = {}
        self._step = 0  # optimizer steps done
        self._logged = 0  # the last step whose tags went to musubi-tuner's logs
        self._texts_written = False
        self.kernels_installed: list[str] | None = None  # what kernel_install.py installed (None: not yet asked)
        self.attention: Any = None  # the attention kernel's AttentionDispatch, where it is installed (attention.py)
        self._samples_logged: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.options.get("enabled", True))

    def train_start(self, args: Any, accelerator: Any) -> None:
        """Models and optimizer prepared: the step clock starts here (the loop's first batch is next)."""
        progress.progress(phase="training")
        if not self.enabled or not accelerator.is_main_process:
            return
        from flux_trainer.metrics.flops import peak_bf16_tflops
        from flux_trainer.metrics.step import StepMetrics

        accum = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        device = accelerator.device
        name = _device_name(device)
        self.metrics = StepMetrics(
            device=device,
            flops_per_step=float(self.options.get("flops_per_step", 0.0)) * accum,
            images_per_step=float(self.options.get("images_per_step", 1)) * accum,
            peak_tflops=peak_bf16_tflops(name) if name != "cpu" else None,
            processes=int(getattr(accelerator, "num_processes", 1) or 1),
        )
        self.metrics.start()

    def batch_arrived(self) -> None:
        if self.metrics is not None:
            self.metrics.mark_data_ready()

    def step_done(self, accelerator: Any, sync_gradients: bool, global_step: int) -> None:
        """After an optimizer step (musubi-tuner's global_step before it counts this one)."""
        if not sync_gradients:
            return
        self._step = global_step + 1
        if self.metrics is not None:
            self._pending = self.metrics.on_step_end(self._step)
        if not accelerator.trackers:  # no TensorBoard: extra_step_logs is not called; the progress line is ours
            self._progress(None)

    def step_logs(self, accelerator: Any, logs: dict[str, Any]) -> dict[str, float]:
        """Our tags for the step musubi-tuner is logging (once per optimizer step: a micro-batch gets none)."""
        if self._step == self._logged:  # a micro-batch of a step already logged, or before the first step
            return {}
        self._logged = self._step
        tags, self._pending = self._pending, {}
        self._progress(logs.get("loss/current"), tags)
        if not self._texts_written:
            self._write_texts(accelerator)
        return tags

    def _progress(self, loss: Any, tags: dict[str, float] | None = None) -> None:
        tags = tags or {}
        progress.progress(step=self._step, total=self.max_steps, loss=loss, step_s=tags.get("time/step_s"),
                          peak_gib=tags.get("vram/peak_gib"))  # fmt: skip

    def _write_texts(self, accelerator: Any) -> None:
        """The run dir's config, command and environment, and the kernels installed, as TensorBoard texts beside the
        scalars."""
        self._texts_written = True
        try:
            writer = accelerator.get_tracker("tensorboard", unwrap=True)
        except Exception:  # noqa: BLE001 - no tensorboard tracker
            return
        from flux_trainer.metrics.tensorboard import write_run_text

        texts = {}
        for name, file in RUN_TEXT_FILES.items():
            path = self.run_dir / file
            if path.is_file():
                texts[name] = path.read_text(encoding="utf-8")
        if self.kernels_installed is not None:
            texts["kernels"] = ", ".join(self.kernels_installed) or "none (plain musubi-tuner compute path)"
        if self.attention is not None:  # decided at the first training forward, before these texts
            texts["attention"] = self.attention.run_line or "no decision yet (no training forward)"
        if texts and getattr(writer, "log_dir", None):
            write_run_text(writer.log_dir, texts)

    def samples_rendered(self, accelerator: Any, sample_dir: Path, step: int) -> list[str]:
        """The images musubi-tuner just rendered from `sample.prompts` into <output_dir>/sample, as TensorBoard images
        (`samples/<n>`) at their step, as on sd-scripts' side."""
        if not accelerator.is_main_process:
            return []
        try:
            writer = accelerator.get_tracker("tensorboard", unwrap=True)
        except Exception:  # noqa: BLE001 - no tensorboard tracker
            return []
        if not getattr(writer, "log_dir", None):
            return []
        from flux_trainer.metrics.tensorboard import write_new_samples

        return write_new_samples(writer.log_dir, sample_dir, self._samples_logged, step)

    def finished(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _device_name(device: Any) -> str:
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "cpu"
