"""The training process for FLUX.2 and Kontext: musubi-tuner's two caching scripts, then its trainer, as one run.

`accelerate launch -m flux_trainer.musubi.runner --run-dir DIR` (or the direct start) runs this. It reads
`runner.json` (written by the parent), caches the latents and the text-encoder outputs, each with musubi-tuner's own
script in a process of its own (flux_trainer.musubi.script: their models leave memory before training; their output
goes to the same log), then trains in this process: the trainer script's own `main()` parses our TOML exactly as its
command line would (`--config_file`, `--dataset_config`), and builds our subclass of its trainer class, which the
module names while main runs. The subclass overrides only musubi-tuner's extension seams (hooks.py: metrics,
progress; on_train_start also installs `kernels=`, kernel_install.py) and, for resume, whole saves and a stop after a
step, a few of its methods and its state helpers (continuation.py). With several processes the main process caches
and the others wait for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flux_trainer.backend.exit_record import EXIT_FILE
from flux_trainer.backend.run_spec import JsonSpec
from flux_trainer.metrics import progress

log = logging.getLogger("flux_trainer.musubi.runner")
CACHED_MARK = ".musubi-cached"  # the main process has cached both: the other processes may train
# the trainer class each training script's main() builds (musubi_tuner.<script>.<class>)
TRAINER_CLASSES = {
    "flux_2_train_network": "Flux2NetworkTrainer",
    "flux_kontext_train_network": "FluxKontextNetworkTrainer",
}


@dataclass
class RunnerSpec(JsonSpec):
    """What the parent tells the training process, beside musubi-tuner's own files."""

    musubi_tuner: str  # the checkout
    scripts: list[str]  # latents, text-encoder outputs, training (musubi_tuner module names)
    cache_latents: list[str]  # each caching script's command line
    cache_text_encoder: list[str]
    train_toml: str
    dataset_toml: str
    max_steps: int | None = None
    random_dit: str | None = None  # a random preset's DiT file: its shapes taught to musubi-tuner's loaders first
    metrics: dict[str, Any] = field(default_factory=lambda: {"enabled": True})
    backend: str = "musubi"
    lora: str | None = None  # the trained LoRA file (output_dir / output_name.safetensors)
    comfy_copy: bool = False  # write its ComfyUI copy beside it after training (lora_format.py)
    kernels: dict[str, Any] = field(default_factory=lambda: {"set": "off"})  # cfg.kernels (kernel_install.py)


class StepFailed(RuntimeError):
    """A caching script ended with an error (its own output, in the log, says why)."""


def cache_step(spec: RunnerSpec, script: str, args: list[str], what: str) -> None:
    """One caching script in a process of its own, its output into ours (the run's log)."""
    progress.progress(phase=what)
    began = time.monotonic()
    random = ["--random-model", spec.random_dit] if spec.random_dit else []
    command = [sys.executable, "-m", "flux_trainer.musubi.script", *random, spec.musubi_tuner, script, *args]
    log.info("%s: %s", what, " ".join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    code = subprocess.run(command, check=False).returncode
    if code != 0:
        raise StepFailed(f"{what} failed (musubi-tuner {script}, exit code {code}); its output is above in train.log")
    log.info("%s: done in %.1f s", what, time.monotonic() - began)


def cache_all(spec: RunnerSpec, run_dir: Path) -> None:
    """Both caches, by the main process; the others wait for its mark (a failure there ends them too)."""
    mark = run_dir / CACHED_MARK
    if _is_main_process():
        cache_step(spec, spec.scripts[0], spec.cache_latents, "caching latents")
        cache_step(spec, spec.scripts[1], spec.cache_text_encoder, "caching the text encoder's outputs")
        mark.write_text("done\n")
        return
    while not mark.exists():
        if (run_dir / EXIT_FILE).exists():
            raise StepFailed("the main process stopped before the caches were made")
        time.sleep(1.0)


def make_trainer_class(base: type, spec: RunnerSpec, run_dir: Path) -> type:
    """Our subclass of musubi-tuner's trainer class, built against the checkout imported at run time."""
    from flux_trainer.musubi.continuation import EpochCounter, MusubiContinuation
    from flux_trainer.musubi.hooks import MusubiHooks

    class FluxTrainMusubiTrainer(base):
        def __init__(self) -> None:
            super().__init__()
            self.flux_train = MusubiHooks(spec.metrics, run_dir, spec.max_steps)
            self.continuation = MusubiContinuation(None, None, "")  # inert until train() makes the run's own
            self._flux_args = None

        def get_optimizer(self, args, trainable_params):
            built = super().get_optimizer(args, trainable_params)  # (name, args, optimizer, train_fn, eval_fn)
            from flux_trainer.musubi.kernel_install import install_optimizer_kernels

            self._flux_optimizer_kernels = install_optimizer_kernels(built[2], spec.kernels)
            return built

        def on_train_start(self, args, accelerator, network, transformer, optimizer):
            super().on_train_start(args, accelerator, network, transformer, optimizer)
            from flux_trainer.musubi import attention
            from flux_trainer.musubi.kernel_install import install_kernels

            progress.progress(phase="kernels")
            on_optimizer = getattr(self, "_flux_optimizer_kernels", [])
            installed = install_kernels(self, args, accelerator, network, transformer, spec.kernels, on_optimizer)
            self.flux_train.kernels_installed = installed
            chosen = attention.installed(accelerator.unwrap_model(transformer))
            self.flux_train.attention = chosen.dispatch if chosen else None  # run/attention in TensorBoard
            self._flux_accelerator = accelerator
            self.flux_train.train_start(args, accelerator)
            self.continuation.train_start(args)  # its loop counts its epochs from max_train_steps next

        def _build_dataset(self, args):
            group, collator, shared_epoch = super()._build_dataset(args)
            return group, collator, EpochCounter(shared_epoch, self.continuation)  # the loop's epochs: the run's

        def _prepare_with_accelerator(self, args, accelerator, *rest, **kwargs):
            self.continuation.accelerator_ready(accelerator)  # before the loader and the network are prepared
            return super()._prepare_with_accelerator(args, accelerator, *rest, **kwargs)

        def scale_shift_latents(self, latents):
            # each training micro-batch, after its fetch and before its noise: a stop request ends here
            self.continuation.step_start(self._flux_args)
            return super().scale_shift_latents(latents)

        def process_batch(self, *args, **kwargs):
            self.flux_train.batch_arrived()
            return super().process_batch(*args, **kwargs)

        def on_post_optimizer_step(self, args, accelerator, network, transformer, sync_gradients, global_step):
            super().on_post_optimizer_step(args, accelerator, network, transformer, sync_gradients, global_step)
            self.flux_train.step_done(accelerator, sync_gradients, self.continuation.run_step(global_step))

        def sample_images(self, accelerator, args, epoch, steps, *rest):
            # a resumed run's samples are named by the run's step (musubi-tuner's own counts from 0 again)
            return super().sample_images(accelerator, args, epoch, self.continuation.run_step(steps), *rest)

        def on_after_sample_images(self, accelerator, args, epoch, steps, *rest):
            super().on_after_sample_images(accelerator, args, epoch, steps, *rest)
            step = self.continuation.run_step(steps)
            self.flux_train.samples_rendered(accelerator, Path(args.output_dir) / "sample", step)

        def extra_step_logs(self, args, logs):
            self.continuation.step_log = True  # the accelerator.log that follows is the step's: the run's step
            extra = dict(super().extra_step_logs(args, logs))
            extra.update(self.flux_train.step_logs(self._flux_accelerator, logs))
            return extra

        def train(self, args):
            from musubi_tuner.utils import train_utils

            self._flux_args = args
            processes = int(os.environ.get("WORLD_SIZE", "1"))
            self.continuation = MusubiContinuation(args.resume, args.seed, args.output_name, processes=processes)
            self.continuation.install(train_utils)
            try:
                return super().train(args)
            finally:
                self.continuation.remove()
                self.flux_train.finished()

    return FluxTrainMusubiTrainer


def train(spec: RunnerSpec, run_dir: Path) -> None:
    """musubi-tuner's training script's main() with our TOML, building our trainer subclass."""
    from flux_trainer.backend.tv_shim import install_torchvision_shim
    from flux_trainer.musubi.checkout import argv, import_module
    from flux_trainer.sdscripts.runner import VRAM_CAP_ENV, apply_vram_cap

    progress.progress(phase="loading the model")
    install_torchvision_shim()
    apply_vram_cap(os.environ.get(VRAM_CAP_ENV))  # `flux-train bench --vram-cap`: this card as a smaller one
    script = spec.scripts[2]
    module = import_module(spec.musubi_tuner, script)
    name = TRAINER_CLASSES[script]
    base = getattr(module, name)
    if spec.random_dit:
        from flux_trainer.musubi.random_model import install_random_model, uninstall_random_model

        for line in install_random_model(spec.random_dit):
            log.info("random model preset: %s", line)
    setattr(module, name, make_trainer_class(base, spec, run_dir))  # main() builds the class it names
    try:
        with argv(f"{script}.py", ["--config_file", spec.train_toml, "--dataset_config", spec.dataset_toml]):
            module.main()
    finally:
        setattr(module, name, base)
        if spec.random_dit:
            uninstall_random_model()


def comfy_copy_step(spec: RunnerSpec) -> None:
    """The trained LoRA's copy in the keys ComfyUI loads (flux_trainer.musubi.lora_format), by the main process. A
    LoRA the copy cannot name is a warning in the log, never a failed run: the trained file is whole either way."""
    from flux_trainer.musubi.lora_format import LoraFormatError, musubi_hashes, write_comfy_copy

    if not (spec.comfy_copy and spec.lora and _is_main_process()):
        return
    lora = Path(spec.lora)
    if not lora.is_file():
        log.warning("no ComfyUI copy: %s was not written", lora)
        return
    try:
        copy, converted = write_comfy_copy(lora, hashes=musubi_hashes(spec.musubi_tuner))
    except LoraFormatError as exc:
        log.warning("no ComfyUI copy: %s", exc)
        return
    except Exception as exc:  # the training finished: a failed copy is a line in the log, not a failed run
        log.warning("no ComfyUI copy: %s: %s", type(exc).__name__, exc)
        return
    log.info("ComfyUI copy: %s (%d modules, alpha folded in)", copy, converted.modules)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flux_trainer.musubi.runner", description=__doc__)
    ap.add_argument("--run-dir", required=True, type=Path)
    ns = ap.parse_args(argv)
    from flux_kernels.runtime.errors import KernelError
    from flux_trainer.sdscripts.continuation import DiskFull, Interrupted, stopped

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = RunnerSpec.read(ns.run_dir)
    code, reason = 1, "crashed"
    try:
        cache_all(spec, ns.run_dir)
        train(spec, ns.run_dir)
        comfy_copy_step(spec)
        code, reason = 0, "finished"
    except StepFailed as exc:
        code, reason = 1, str(exc)
        log.error("%s", reason)
    except KernelError as exc:
        code, reason = 2, f"kernels: {exc}"  # a kernel the user named cannot run here
        log.error("%s", reason)
    except (Interrupted, KeyboardInterrupt, DiskFull) as exc:  # a stop request, an interrupt, a full disk
        code, reason = stopped(exc, log)
    finally:
        if _is_main_process():
            try:
                (ns.run_dir / EXIT_FILE).write_text(json.dumps({"code": code, "reason": reason}) + "\n")
            except OSError as exc:
                log.warning("exit record not written (%s): %s", EXIT_FILE, exc)
    return code


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
