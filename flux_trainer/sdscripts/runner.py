"""The training process: sd-scripts' FluxNetworkTrainer, subclassed, fed our TOMLs.

`accelerate launch -m flux_trainer.sdscripts.runner --run-dir DIR` starts this. It reads `runner.json` from
the run dir (written by the parent), puts the checkout on sys.path, parses the TOML with sd-scripts' own
`setup_parser()` and `read_config_from_file`, and calls `train(args)` on our subclass. The subclass only
overrides sd-scripts' hook methods: model loaded (random presets, kernels), step start/end (metrics), the step's
noise prediction (position ids kept on the device with flux_prologue), the loss it returns (read without a sync,
train.sync_free); kernels whose target is the trainer (flux_kernels.single_process, coalesced_reduce) wrap its
methods on the instance. For the run, two of sd-scripts' module functions are wrapped: `get_optimizer` (the
optimizer's kernels) and `calculate_sha256` (the base model's hash once per file, file_hash).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flux_trainer.backend.exit_record import EXIT_FILE, child_exit_code, child_reason  # noqa: F401 - API
from flux_trainer.backend.run_spec import JsonSpec
from flux_trainer.metrics import progress
from flux_trainer.metrics.tensorboard import VALIDATION_TAGS
from flux_trainer.sdscripts.checkout import SdScriptsModules, import_sd_scripts, sd_scripts_argv

log = logging.getLogger("flux_trainer.runner")
EXIT_NONFINITE_LOSS = 3
VRAM_CAP_ENV = "FLUX_TRAIN_VRAM_CAP_GIB"  # set by `flux-train bench --vram-cap`


@dataclass
class RunnerSpec(JsonSpec):
    """What the parent tells the training process, beside sd-scripts' own TOMLs."""

    sd_scripts: str
    train_toml: str
    dataset_toml: str
    random_model_dir: str | None = None  # a random preset whose shapes sd-scripts' loaders cannot build
    kernels: dict[str, Any] = field(default_factory=lambda: {"set": "off"})
    metrics: dict[str, Any] = field(default_factory=lambda: {"enabled": True})
    tf32: bool = False
    pin_memory: bool = True  # train.pin_memory: pinned batches, non-blocking copies (hooks.pin_batches)
    staged_copy: bool = True  # train.staged_copy: the model to the GPU through pinned buffers (model_copy)
    sync_free: bool = True  # train.sync_free: the loop's per-step reads without waiting for the step (step_values)
    # memory.checkpoint_skip with what decides it: {"checkpoint_skip", "tier_gib", "blocked"} (checkpoint_fit)
    memory: dict[str, Any] = field(default_factory=lambda: {"checkpoint_skip": "0"})
    t5xxl_fp8: bool = False  # memory.t5xxl_fp8: T5-XXL in fp8 when it encodes the captions (an 8 GB card)


def make_trainer_class(mods: SdScriptsModules, spec: RunnerSpec, run_dir: Path, startup: Any = None) -> type:
    """Our FluxNetworkTrainer subclass, built against the checkout imported at run time. `startup`: this process's
    StartupClock (metrics.startup), marked at each phase sd-scripts goes through until the first step."""
    from flux_trainer.config.paths import cache_root
    from flux_trainer.sdscripts import file_hash, hooks, sample_decode, te_cache, threads
    from flux_trainer.sdscripts.continuation import Continuation

    base = mods.flux_train_network.FluxNetworkTrainer

    class FluxTrainTrainer(base):
        def __init__(self) -> None:
            super().__init__()
            self.flux_train = hooks.RunHooks(spec, run_dir, startup=startup)
            self.continuation = Continuation(None, None, "")  # inert until train() makes the run's own
            self._decode_said = [False]  # the samples' decode fell back to the CPU once (sample_decode)

        def train(self, args):
            # sd-scripts builds the optimizer with a module function, inside train(), and gives it to no method we
            # could override: wrap that function for the duration of the run (restored after, logged by the hook)
            build = mods.train_util.get_optimizer

            def get_optimizer(*a, **kw):
                name, described, optimizer = build(*a, **kw)
                self.flux_train.optimizer_created(optimizer)
                return name, described, optimizer

            # and it reads the whole base model for its sha256 (the LoRA's metadata) at every start: once per file
            sha256 = mods.train_util.calculate_sha256
            mods.train_util.get_optimizer = get_optimizer
            mods.train_util.calculate_sha256 = file_hash.cached(sha256, cache_root() / file_hash.CACHE_FILE)
            # resume continues the run's steps, saves appear whole, a stop request ends after a step (continuation)
            self.continuation = Continuation(
                args.resume, args.seed, args.output_name, processes=int(os.environ.get("WORLD_SIZE", "1"))
            )
            self.continuation.install(mods)
            self.flux_train.trainer_created(self)
            try:
                return super().train(args)
            finally:
                mods.train_util.get_optimizer = build
                mods.train_util.calculate_sha256 = sha256
                self.continuation.remove()
                self.flux_train.train_finished()

        def load_target_model(self, args, weight_dtype, accelerator):
            self.continuation.accelerator_ready(accelerator)
            phase("loading the model")
            self.flux_train.startup.mark("settings and dataset")
            if spec.random_model_dir:
                from flux_trainer.sdscripts.random_model import load_random_models

                log.info(
                    "random model preset: building it from %s (not sd-scripts' full-size loaders)",
                    spec.random_model_dir,
                )
                clip_l, t5xxl, ae, flux = load_random_models(Path(spec.random_model_dir), weight_dtype, "cpu")
                self.is_swapping_blocks = False
                version = mods.flux_utils.MODEL_VERSION_FLUX_V1
                if clip_l is None:  # Chroma: sd-scripts' own loader gives it the dummy CLIP-L too
                    clip_l, version = mods.flux_utils.dummy_clip_l().eval(), mods.flux_utils.MODEL_VERSION_CHROMA
                result = (version, [clip_l, t5xxl], ae, flux)
            else:
                with threads.cpu_share("loading the base model"):
                    result = super().load_target_model(args, weight_dtype, accelerator)
            self.flux_train.model_loaded(result[3], accelerator)
            # the model has loaded: its sha256 (the LoRA's metadata, asked for before the first step) is read now,
            # on a thread beside the caching and the kernel checks (file_hash), unless the cache has it
            ahead = getattr(mods.train_util.calculate_sha256, "ahead", None)
            if ahead is not None and args.pretrained_model_name_or_path:
                ahead(str(args.pretrained_model_name_or_path))
            return result

        def cache_text_encoder_outputs_if_needed(self, args, accelerator, unet, vae, text_encoders, dataset, dtype):
            phase("caching the text encoders' outputs")
            strategy = mods.train_util.TextEncoderOutputsCachingStrategy.get_strategy()
            if te_cache.all_on_disk(args, dataset, strategy):  # sd-scripts would move the models to encode nothing
                dataset.new_cache_text_encoder_outputs(text_encoders, accelerator)  # its check; records the files
                accelerator.wait_for_everyone()  # as many barriers as sd-scripts' path: ranks that disagree still meet
                log.info("text-encoder outputs: every one on disk, the models stay where they are (no T5 to the GPU)")
                result = None
            else:  # the last cache sd-scripts builds
                if spec.t5xxl_fp8:
                    t5_to_fp8(text_encoders[1])
                result = super().cache_text_encoder_outputs_if_needed(
                    args, accelerator, unet, vae, text_encoders, dataset, dtype
                )
            self.flux_train.caches_ready(args)
            return result

        def prepare_unet_with_accelerator(self, args, accelerator, unet):
            phase("kernels, and the model to the device")
            whole = not self.is_swapping_blocks  # with block swap sd-scripts places the blocks itself
            # the model and its LoRA to the GPU first where that can be done, so the kernels install and check there
            moved = whole and self.flux_train.model_to_device(unet, accelerator, with_network=True)
            self.flux_train.before_prepare(unet, args, accelerator)
            if whole and not moved:
                self.flux_train.model_to_device(unet, accelerator)
            return super().prepare_unet_with_accelerator(args, accelerator, unet)

        def on_step_start(self, args, accelerator, network, text_encoders, unet, batch, weight_dtype, is_train=True):
            if is_train:
                self.continuation.step_start(args)  # a stop request ends here; this micro-batch's seed
                self.flux_train.step_start(accelerator, network)
            return super().on_step_start(args, accelerator, network, text_encoders, unet, batch, weight_dtype, is_train)

        def process_batch(self, *args, **kwargs):
            return self.flux_train.loss_made(super().process_batch(*args, **kwargs))

        def get_noise_pred_and_target(self, args, accelerator, *rest, **kwargs):
            # the image position ids sd-scripts builds on the host every step: kept on the device with flux_prologue
            build = mods.flux_utils.prepare_img_ids
            mods.flux_utils.prepare_img_ids = self.flux_train.position_ids(build, accelerator.device)
            try:
                return super().get_noise_pred_and_target(args, accelerator, *rest, **kwargs)
            finally:
                mods.flux_utils.prepare_img_ids = build

        # sd-scripts' global step counts this process's steps; the run's step adds the resumed state's
        def sample_images(self, accelerator, args, epoch, global_step, *rest):
            step = self.continuation.run_step(global_step)
            ae = rest[1] if len(rest) > 1 else None  # (device, ae, tokenizer, text_encoder, flux)
            with sample_decode.cpu_fallback(ae, self._decode_said):
                result = super().sample_images(accelerator, args, epoch, step, *rest)
            self.flux_train.log_new_samples(accelerator, Path(args.output_dir) / "sample", step)
            return result

        def step_logging(self, accelerator, logs, global_step, epoch):
            step = self.continuation.run_step(global_step)
            if logs and all(k.startswith(VALIDATION_TAGS) for k in logs):
                # sd-scripts logs the step's validation loss through here too, after the step's own logs: the
                # same run and step, without counting a second step in the metrics or the progress line
                self.flux_train.validated()
                return super().step_logging(accelerator, logs, step, epoch)
            tags = self.flux_train.step_end(accelerator, logs, step)
            logs.update(tags)
            super().step_logging(accelerator, logs, step, epoch)
            self.flux_train.step_logged(accelerator, step)
            if getattr(accelerator, "sync_gradients", True):  # the terminal's progress line (flux-train shows it)
                total = self.continuation.max_steps
                progress.progress(step=step, total=total, loss=logs.get("loss/current"),
                                  step_s=tags.get("time/step_s"), peak_gib=tags.get("vram/peak_gib"))  # fmt: skip

        def epoch_logging(self, accelerator, logs, global_step, epoch):
            if any(k.startswith(VALIDATION_TAGS) for k in logs):
                self.flux_train.validated()  # the epoch's validation loss
            super().epoch_logging(accelerator, logs, self.continuation.run_step(global_step), epoch)

        def val_logging(self, accelerator, logs, global_step, epoch, val_step):
            super().val_logging(accelerator, logs, self.continuation.run_step(global_step), epoch, val_step)

    return FluxTrainTrainer


def t5_to_fp8(t5xxl: Any) -> None:
    """T5-XXL's weights cast to fp8 (e4m3) where they are (on the CPU, before sd-scripts moves it to encode): sd-scripts
    then runs it as it runs an fp8 T5 file (its fp8 forward for the feed-forward layers), in half the memory."""
    import torch

    if t5xxl.dtype != torch.float8_e4m3fn:
        before = sum(p.numel() * p.element_size() for p in t5xxl.parameters())
        t5xxl.to(torch.float8_e4m3fn)
        log.info("memory.t5xxl_fp8: T5-XXL cast to fp8 to encode the captions (%.1f GB -> %.1f GB)", before / 1e9,
                 sum(p.numel() * p.element_size() for p in t5xxl.parameters()) / 1e9)  # fmt: skip


def phase(name: str) -> None:
    """The phase before the first step, for the terminal's progress line (main process only)."""
    if _is_main_process():
        progress.progress(phase=name)


def parse_sd_scripts_args(mods: SdScriptsModules, spec: RunnerSpec) -> argparse.Namespace:
    """Exactly what `flux_train_network.py --config_file X --dataset_config Y` does with its arguments."""
    parser = mods.flux_train_network.setup_parser()
    argv = ["--config_file", spec.train_toml, "--dataset_config", spec.dataset_toml]
    with sd_scripts_argv(argv):
        args = parser.parse_args(argv)
        mods.train_util.verify_command_line_training_args(args)
        return mods.train_util.read_config_from_file(args, parser)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flux_trainer.sdscripts.runner", description=__doc__)
    ap.add_argument("--run-dir", required=True, type=Path)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = RunnerSpec.read(ns.run_dir)
    if spec.tf32:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    apply_vram_cap(os.environ.get(VRAM_CAP_ENV))
    from flux_kernels.runtime.errors import KernelError
    from flux_trainer.metrics.startup import StartupClock
    from flux_trainer.sdscripts.continuation import DiskFull, Interrupted, stopped
    from flux_trainer.sdscripts.hooks import NonFiniteLoss

    startup = StartupClock.from_env()
    code, reason = 1, "crashed"
    try:
        mods = import_sd_scripts(spec.sd_scripts)
        startup.mark("imports")
        args = parse_sd_scripts_args(mods, spec)
        trainer = make_trainer_class(mods, spec, ns.run_dir, startup)()
        trainer.train(args)
        code, reason = 0, "finished"
    except KernelError as exc:
        code, reason = 2, f"kernels: {exc}"
        log.error("%s", reason)
    except NonFiniteLoss as exc:
        code, reason = EXIT_NONFINITE_LOSS, str(exc)
        log.error("stopped: %s", exc)
    except (Interrupted, KeyboardInterrupt, DiskFull) as exc:  # a stop request, an interrupt, a full disk
        code, reason = stopped(exc, log)
    finally:
        if _is_main_process():
            try:  # never raised over the failure that ended training (a full disk fails both)
                (ns.run_dir / EXIT_FILE).write_text(json.dumps({"code": code, "reason": reason}) + "\n")
            except OSError as exc:
                log.warning("exit record not written (%s): %s", EXIT_FILE, exc)
    return code


def apply_vram_cap(cap_gib: str | None) -> None:
    """`flux-train bench --vram-cap GB`: the card is treated as having that much memory, so a large card proves what
    fits a small one. PyTorch's per-process memory fraction is set to the cap less what the card already holds
    outside PyTorch's cache (this process's CUDA context, other processes), as a card of that size would have left."""
    if not cap_gib:
        return
    import torch

    if not torch.cuda.is_available():
        return
    index = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    outside = total - free - torch.cuda.memory_reserved(index)
    fraction = min(1.0, max(0.0, float(cap_gib) * 2**30 - outside) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info(
        "VRAM cap: the card as %.1f GiB of its %.1f GiB: %.2f GiB outside PyTorch now, PyTorch's fraction %.4f",
        float(cap_gib), total / 2**30, outside / 2**30, fraction,
    )  # fmt: skip


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
