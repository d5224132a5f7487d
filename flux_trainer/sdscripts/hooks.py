"""What our trainer subclass does at sd-scripts' hook points: kernels before the model is prepared, metrics
and health per step, run texts once. Kept apart from runner.py so it is testable without a trainer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flux_trainer.sdscripts import rng_state
from flux_trainer.sdscripts.compile_report import (
    CacheBypassReasons,
    CompileState,
    compile_cache_counts,
    cudagraph_skips,
    report_compile_cache,
)
from flux_trainer.sdscripts.kernel_install import install_kernels, install_optimizer_kernels, install_trainer_kernels

log = logging.getLogger("flux_trainer.runner")
RANK_REDUCE_EVERY = 25  # steps between the max-over-ranks VRAM collective (one gather + one host copy)
# Optimizer steps of this process (a resumed run counts from its own first step, whatever sd-scripts' global step):
COMPILE_CHECKED_AT = 1  # after which the compiled blocks' forward and backward exist
OFFLOAD_REPORTED_AT = 2  # after which activation_offload carries checkpoint_skip=auto's plan
ROOM_FOR_MODEL = 0.9  # the model moves before the kernels only into this share of the room PyTorch has on the card
GRAPHS_CHECKED_AT = 3  # after which the compiled blocks have been recorded as CUDA graphs
RUN_TEXT_FILES = {"config": "config.yaml", "command": "command.txt", "environment": "env.json"}


class NonFiniteLoss(RuntimeError):
    """Raised from step logging to stop sd-scripts' loop when the loss stays NaN/inf."""


class RunHooks:
    def __init__(self, spec: Any, run_dir: Path, startup: Any = None) -> None:
        from flux_trainer.metrics.startup import StartupClock

        self.spec = spec
        self.startup = startup if startup is not None else StartupClock.from_env()  # phases up to the first step
        self._startup_line = ""
        self.run_dir = Path(run_dir)
        self.metrics = None
        self.loss_guard = None
        self.slowdown = None
        self.profiler = None
        self.memory_snapshot = None
        self._accelerator = None
        self._unet = None
        self.kernels_installed: list[str] = []
        self._texts_written = False
        self._samples_logged: set[str] = set()
        self._micro_steps = 0
        self._steps_ended = 0  # optimizer steps this process has logged (step_end calls)
        self._ranks_peak: dict[str, float] = {}
        self._max_steps = 0
        self._optimizer_kernels: list[str] = []
        self._trainer_kernels: list[str] = []
        self._optimizer = None  # sd-scripts' optimizer (its parameters: what the LoRA trains)
        self._copy_failed = False  # train.staged_copy failed once: accelerate moves the model
        self._bypass_reasons: CacheBypassReasons | None = None
        self._compile_cache = ""  # the cache line after the first step (log and TensorBoard's run/compile_cache)
        self._compiled: CompileState | None = None  # the compile counts and seconds at the last report
        self.fit = None  # memory.checkpoint_skip (checkpoint_fit.CheckpointFit), from before_prepare on
        self._accumulation = 1
        self._retries_warned = False
        self._ids: tuple[Any, Any] | None = None  # (sd-scripts' prepare_img_ids, its kept-on-device stand-in)
        self.norms = None  # train.sync_free: the network's norm means, logged once on the host (step_values)
        self._rng_before_caches: dict | None = None  # the generators before sd-scripts built its caches

    def model_loaded(self, flux: Any, accelerator: Any) -> None:
        """The transformer exists; kernels wait for before_prepare, when the LoRA is already applied. The generators
        are noted: sd-scripts builds its caches next (caches_ready)."""
        self.startup.mark("model load")
        self._rng_before_caches = rng_state.snapshot()

    def caches_ready(self, args: Any) -> None:
        """The latent / text-encoder caches exist: the generators go back to where they were before sd-scripts built
        them. Building them draws random numbers (the VAE samples its latents), reusing them draws none, so without
        this a run that builds the caches and one that reuses them (plain sd-scripts after our run, in the bench)
        would train from different random states: LoRA init, data order and noise. Not a re-seed: whatever sd-scripts
        drew since its `set_seed` (its dataset's bucket shuffle) stays drawn, as in plain sd-scripts."""
        self.startup.mark("caches")
        before = getattr(self, "_rng_before_caches", None)
        if before is None:
            return
        rng_state.restore(before)
        if not getattr(self, "_rng_restored", False):
            log.info("random state put back to before caching: caches built or reused, the run draws the same")
            self._rng_restored = True

    def trainer_created(self, trainer: Any) -> None:
        """Our trainer subclass exists, train() is about to run: the kernels that change its own steps go in."""
        with rng_state.untouched():  # a kernel's check draws nothing the run would have drawn
            self._trainer_kernels = install_trainer_kernels(trainer, self.spec.kernels)

    def position_ids(self, build: Any, device: Any) -> Any:
        """What sd-scripts' `prepare_img_ids` should be during a step: with flux_prologue, the ids kept on `device`
        per shape (flux_kernels.patches.prologue.kept_on: no host build and pageable copy, a sync, every step); else
        `build` itself."""
        if "flux_prologue" not in self.kernels_installed:
            return build
        if self._ids is None or self._ids[0] is not build:
            from flux_kernels.patches.prologue import kept_on

            self._ids = (build, kept_on(device, build))
        return self._ids[1]

    def loss_made(self, loss: Any) -> Any:
        """What sd-scripts' `process_batch` returns to its loop: with train.sync_free, the loss with its value
        already on its way to the host, so the loop's `loss.detach().item()` does not wait for the backward."""
        import torch

        from flux_trainer.sdscripts.step_values import early_loss

        if not getattr(self.spec, "sync_free", True) or not isinstance(loss, torch.Tensor):
            return loss
        return early_loss(loss)

    def optimizer_created(self, optimizer: Any) -> None:
        """sd-scripts just built the optimizer (before its LR scheduler wraps the step): optimizer kernels go in."""
        self.startup.mark("LoRA and optimizer")
        self._optimizer = optimizer
        with rng_state.untouched():
            self._optimizer_kernels = install_optimizer_kernels(optimizer, self.spec.kernels)
        self.startup.mark("optimizer kernels")  # with their probe on the device

    def before_prepare(self, unet: Any, args: Any, accelerator: Any) -> None:
        with rng_state.untouched():  # probes and checks: kernels=auto draws what kernels=off draws
            self.kernels_installed = install_kernels(unet, self.spec.kernels, accelerator.device)
        self.startup.mark("kernels")
        self._unet = unet
        if "compile_blocks" in self.kernels_installed:
            self._bypass_reasons = CacheBypassReasons().install()  # the blocks compile at their first call, later
        self.kernels_installed += self._optimizer_kernels + self._trainer_kernels
        if self.kernels_installed or self.spec.kernels.get("set", "off") != "off":
            log.info("kernels installed: %s", ", ".join(self.kernels_installed) or "none")
        self._accelerator = accelerator
        if getattr(self.spec, "pin_memory", True) and (line := pin_batches(accelerator)):
            log.info(line)
        self._max_steps = int(getattr(args, "max_train_steps", 0) or 0)  # final by now (sd-scripts sets it earlier)
        self._accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        self.fit = make_checkpoint_fit(
            getattr(self.spec, "memory", {}) or {}, accelerator.device, self.kernels_installed
        )
        if self.spec.metrics.get("profile_at"):
            from flux_trainer.metrics.profile import StepProfiler

            self.profiler = StepProfiler(
                self.run_dir,
                at=int(self.spec.metrics["profile_at"]),
                steps=int(self.spec.metrics.get("profile_steps", 3)),
                accumulation=int(getattr(args, "gradient_accumulation_steps", 1) or 1),
                rank=int(getattr(accelerator, "process_index", 0)),
                python=bool(self.spec.metrics.get("profile_python", False)),
            )
        if self.spec.metrics.get("memory_snapshot_at"):
            from flux_trainer.metrics.memory_snapshot import MemorySnapshot

            self.memory_snapshot = MemorySnapshot(
                self.run_dir,
                at=int(self.spec.metrics["memory_snapshot_at"]),
                accumulation=int(getattr(args, "gradient_accumulation_steps", 1) or 1),
                rank=int(getattr(accelerator, "process_index", 0)),
            )
        if self.spec.metrics.get("enabled", True):
            from flux_trainer.metrics.health import LossGuard, SlowdownDetector

            self.metrics = make_step_metrics(args, accelerator, self.spec.metrics)
            self.loss_guard = LossGuard(patience=3)
            self.slowdown = SlowdownDetector(nvml=self.metrics.nvml)

    def model_to_device(self, unet: Any, accelerator: Any, with_network: bool = False) -> bool:
        """Where accelerate's prepare is about to move the whole model to the GPU, move it first through pinned
        staging buffers on several threads (model_copy, train.staged_copy); accelerate then finds it there.
        `with_network`: before the kernels go in, so that they install and check their blocks on the GPU; the LoRA
        modules attached to the model move with it, and only where they hold every parameter the optimizer trains
        and the model as it is fits the room PyTorch has on the card (a bf16 base that fp8_matmul is to quantise
        may not); else False, nothing moved: the kernels go in on the CPU model as before, and the model moves
        after them. True when the model was moved."""
        from flux_trainer.sdscripts import model_copy
        from flux_trainer.sdscripts.threads import core_share

        if self._copy_failed or not getattr(self.spec, "staged_copy", True):
            return False
        if not model_copy.moves_whole_model(accelerator):
            return False
        attached = []
        if with_network:
            attached = model_copy.attached_modules(unet)
            trained = {id(p) for g in getattr(self._optimizer, "param_groups", []) for p in g["params"]}
            if not trained or not trained <= {id(p) for m in attached for p in m.parameters()}:
                return False
            from flux_trainer.sdscripts.checkpoint_fit import DeviceMemory, room_bytes

            if model_copy.host_bytes(unet) > room_bytes(DeviceMemory(accelerator.device)) * ROOM_FOR_MODEL:
                return False
        try:
            report = model_copy.staged_copy(unet, accelerator.device, threads=core_share())
        except Exception as e:  # noqa: BLE001 - e.g. no page-locked memory here: the model is untouched until the swap
            log.warning("train.staged_copy failed (%s: %s); accelerate moves the model as usual", type(e).__name__, e)
            self._copy_failed = True
            return False
        for m in attached:  # the LoRA: small, the plain way
            m.to(accelerator.device)
        self.startup.mark("model to the device")
        if report is not None:
            log.info(report.line(accelerator.device) + (" with the LoRA, before the kernels" if attached else ""))
        return True

    def step_start(self, accelerator: Any = None, network: Any = None) -> None:
        """Runs on every rank: the data-wait mark, and every RANK_REDUCE_EVERY micro-steps the peak VRAM of the
        busiest rank (a collective, so it cannot live in step_logging, which sd-scripts calls on rank 0 only).
        The profiler window opens and closes here too, on every rank. At the first step, with lora_grad_norms,
        the network's per-step `grad_norms()` (sd-scripts logs its mean) is served from the batched norms, and its
        weight-norm loops run over the modules with GGPO only."""
        self._micro_steps += 1
        if self._micro_steps == 1:
            self.startup.mark("prepare")  # accelerate's prepare (and the model's move unless staged), the loop's set-up
        if self._micro_steps == 1 and "compile_blocks" in self.kernels_installed:
            self._compiled = CompileState.now()  # what was compiled before training (the registry's compile probe)
        if self._micro_steps == 1 and network is not None and "lora_grad_norms" in self.kernels_installed:
            from flux_kernels.patches import lora_norms

            if lora_norms.install_network(network):
                log.info("lora_grad_norms: the network's grad_norms() (norm/avg_grad_norm) from the batched norms")
            if (ggpo := lora_norms.install_norm_loops(network)) is not None:
                log.info("lora_grad_norms: the network's weight-norm loops over the %d modules with GGPO", ggpo)
        if self._micro_steps == 1 and network is not None and getattr(self.spec, "sync_free", True):
            self.defer_norms(accelerator, network)
        if self.fit is not None and self._unet is not None:
            if self._micro_steps == 1 and (line := self.fit.start(self._unet)):
                log.info(line)
            elif self._micro_steps == self._accumulation + 1 and (line := self.fit.decide()):
                log.info(line)
        if "cuda_graphs" in self.kernels_installed:
            import torch

            # a new step: the graphs' outputs from the last one are dead (sd-scripts set the gradients to None)
            torch.compiler.cudagraph_mark_step_begin()
        if self.memory_snapshot is not None and accelerator is not None:
            if self.memory_snapshot.on_batch(self._micro_steps, accelerator.device):
                self.run_text(accelerator, "memory", self.memory_snapshot.text)
        if self.profiler is not None and accelerator is not None:
            if self.profiler.on_batch(self._micro_steps, accelerator.device):
                self.profile_written(accelerator)
        if self.metrics is None:
            return
        self.metrics.mark_data_ready()
        if accelerator is not None and getattr(accelerator, "num_processes", 1) > 1:
            if self._micro_steps % RANK_REDUCE_EVERY == 0:
                from flux_trainer.metrics.step import reduce_max_across_ranks

                peak = run_peak_gib(accelerator.device)
                self._ranks_peak = {
                    "vram/peak_gib_max_over_ranks": reduce_max_across_ranks({"vram/peak_gib": peak}, accelerator)[
                        "vram/peak_gib"
                    ]
                }

    def defer_norms(self, accelerator: Any, network: Any) -> None:
        """train.sync_free: the network's per-step norm means reach TensorBoard once they are on the host, at their
        own step, instead of the loop waiting for them (step_values.DeferredNorms). They are kept only where
        sd-scripts would log them: the main process, with TensorBoard."""
        from flux_trainer.sdscripts.step_values import DeferredNorms

        keep = self.metrics is not None and getattr(accelerator, "is_main_process", True)
        self.norms = DeferredNorms(keep=keep)
        if names := self.norms.install(network):
            log.info(
                "sync-free steps: the loss read from a copy made at the forward, %s logged once on the host "
                "(train.sync_free)",
                ", ".join(f"{n}()" for n in names),
            )

    def report_compiling(self, step: int) -> None:
        """After this process's first step: the compile caches' outcomes and the seconds spent compiling. After a
        later step that compiled more (selective checkpointing's plan at the second step, a new bucket shape): what
        it compiled. `step` is sd-scripts' global step, for the message."""
        reasons = self._bypass_reasons.reasons if self._bypass_reasons else None
        if self._steps_ended == COMPILE_CHECKED_AT:
            before, self._compiled = self._compiled, CompileState.now()
            self._compile_cache = report_compile_cache(reasons, self._compiled, before=before)
        elif self._compiled is not None and compile_cache_counts() != self._compiled.counts:  # the counters alone
            self._compiled, since = CompileState.now(), self._compiled
            report_compile_cache(reasons, self._compiled, since=since, step=step)

    def step_end(self, accelerator: Any, logs: dict, global_step: int) -> dict[str, float]:
        """Tags to add to sd-scripts' logs for this step. Runs on the main process only (sd-scripts tracks there).
        A profile window still open after the last step closes here, so it holds training steps only, not the final
        save (which once passed for 456 syncs per step: the LoRA's tensors copied to the CPU)."""
        self._steps_ended += 1
        if self._steps_ended == 1:
            self.startup.mark("first step")
            self._startup_line = self.startup.line()
            log.info(self._startup_line)
        if self.profiler is not None and self._max_steps and global_step >= self._max_steps and self.profiler.close():
            self.profile_written(accelerator)
        if self.memory_snapshot is not None and self._max_steps and global_step >= self._max_steps:
            if self.memory_snapshot.close():  # the last step's allocations, not the final save's
                self.run_text(accelerator, "memory", self.memory_snapshot.text)
        if self.norms is not None:
            self.norms.label(global_step)
            self.norms.flush(accelerator.log)
        if "compile_blocks" in self.kernels_installed:
            self.report_compiling(global_step)
        if "cuda_graphs" in self.kernels_installed and self._steps_ended == GRAPHS_CHECKED_AT:
            self.report_cudagraph_skips()
        if self.fit is not None:
            self.fit.note_peak()  # before the step metrics reset PyTorch's peak
        offloaded = self.offloaded()
        if self.metrics is None:
            return {}
        if not self._texts_written:
            self._texts_written = True
            self.write_run_texts(accelerator)
            throttle_tracker_flush(accelerator)
        tags = self.metrics.on_step_end(global_step)
        if self._steps_ended == 1:
            tags["time/startup_s"] = self.startup.total()
        tags.update(self._ranks_peak)
        self._ranks_peak = {}
        if self.fit is not None and self.fit.total:
            tags["memory/checkpointed_blocks"] = float(self.fit.total - self.fit.kept)
            if "selective_checkpoint" in self.kernels_installed:
                tags["memory/selective_blocks"] = float(self.fit.selective)
        tags.update(offloaded)
        if "loss/current" in logs and (msg := self.loss_guard.check(float(logs["loss/current"]), global_step)):
            log.error(msg)
            raise NonFiniteLoss(msg + f"; the last saved state in {self.run_dir} is intact (resume=auto)")
        if "time/step_s" in tags and (msg := self.slowdown.observe(tags["time/step_s"], global_step)):
            log.warning(msg)
        if tags.get("vram/alloc_retries") and not self._retries_warned:
            self._retries_warned = True
            log.warning(alloc_retries_message(tags["vram/alloc_retries"], global_step, self.fit))
        return tags

    def validated(self) -> None:
        """sd-scripts' validation loss just ran, after the step's end: not counted in the next step's time (nor
        taken for a slowdown by the health checks)."""
        if self.metrics is not None:
            self.metrics.skip_since_step_end()

    def step_logged(self, accelerator: Any, global_step: int) -> None:
        """After sd-scripts logged the step (main process): at the last step, the norm means still on their way
        to the host are waited for and written, before sd-scripts closes TensorBoard. Not earlier, so the last
        step's `loss/current` event keeps the time its forward ended, like every other step's."""
        if self.norms is not None and self._max_steps and global_step >= self._max_steps:
            self.norms.flush(accelerator.log, wait=True)

    def offloaded(self) -> dict[str, float]:
        """activation_offload's step: `memory/offloaded_gib` (what the last forward sent to host memory), and after
        this process's second step (the first with selective checkpointing's plan) a log line with the host memory it
        holds."""
        if "activation_offload" not in self.kernels_installed or self._unet is None:
            return {}
        from flux_kernels.memory.activation_offload import offloader_of

        off = offloader_of(self._unet)
        if off is None:
            return {}
        if self._steps_ended == OFFLOAD_REPORTED_AT:
            log.info(
                "activation_offload: %d saved tensors, %.2f GiB a step to host memory and back (%.2f GiB page-locked)",
                off.step_tensors,
                off.step_bytes / 2**30,
                off.host_bytes / 2**30,
            )
        return {"memory/offloaded_gib": off.step_bytes / 2**30}

    def report_cudagraph_skips(self) -> None:
        """By now every block has been recorded (the first call of a compiled graph runs it plain, the second
        records it): say whether some run without CUDA graphs, and where to read why."""
        skips = cudagraph_skips()
        if skips:
            log.warning(
                "cuda graphs: %d compiled graph(s) run without them (inductor skipped them; TORCH_LOGS=cudagraphs "
                "says why): those blocks still launch kernel by kernel",
                skips,
            )
        else:
            log.info("cuda graphs: every compiled block replays from CUDA graphs")

    def train_finished(self) -> None:
        """sd-scripts' train() returned or raised: close a memory recording or profile window the run ended inside
        (each writes what it saw). Runs in a `finally`, so a failure here is logged, never raised over the exception
        that ended training."""
        try:
            if self.memory_snapshot is not None and self.memory_snapshot.close():
                self.run_text(self._accelerator, "memory", self.memory_snapshot.text)
            if self.profiler is not None and self.profiler.close():
                self.profile_written(self._accelerator)
        except Exception as e:  # noqa: BLE001 - see above
            log.warning("profile not written: %s: %s", type(e).__name__, e)

    def profile_written(self, accelerator: Any) -> None:
        if not getattr(accelerator, "is_main_process", True):
            return
        log.info("profile of %d step(s) in %s:\n%s", self.profiler.steps, self.profiler.out_dir, self.profiler.text)
        self.run_text(accelerator, "profile", self.profiler.text)

    def run_text(self, accelerator: Any, name: str, text: str | None) -> None:
        """TensorBoard text `run/<name>` from the main process, where its tracker has a log dir."""
        if text is None or not getattr(accelerator, "is_main_process", True):
            return
        logdir = tracker_logdir(accelerator)
        if logdir is not None:
            from flux_trainer.metrics.tensorboard import write_run_text

            write_run_text(logdir, {name: text})

    def log_new_samples(self, accelerator: Any, sample_dir: Path, global_step: int) -> list[str]:
        """Images sd-scripts just rendered into <output_dir>/sample, as TensorBoard images (`samples/<n>`)."""
        logdir = tracker_logdir(accelerator)
        if not getattr(accelerator, "is_main_process", True) or logdir is None:
            return []
        from flux_trainer.metrics.tensorboard import write_new_samples

        return write_new_samples(logdir, sample_dir, self._samples_logged, global_step)

    def write_run_texts(self, accelerator: Any) -> None:
        """Config, command, environment profile, GPU and kernels as TensorBoard text, in sd-scripts' run."""
        from flux_trainer.metrics.tensorboard import write_hparams, write_run_text

        logdir = tracker_logdir(accelerator)
        if logdir is None:
            return
        texts = {k: (self.run_dir / f).read_text() for k, f in RUN_TEXT_FILES.items() if (self.run_dir / f).exists()}
        texts["gpu"] = device_name(accelerator.device)
        texts["kernels"] = ", ".join(self.kernels_installed) or "none (plain sd-scripts compute path)"
        if "attention" in self.kernels_installed:
            from flux_kernels.patches.patch import attention_decision

            texts["attention"] = attention_decision(self._unet) or "no decision yet (no forward at a FLUX shape)"
        if self._compile_cache:
            texts["compile_cache"] = self._compile_cache
        if self._startup_line:
            texts["startup"] = self._startup_line
        write_run_text(logdir, texts)
        if (self.run_dir / "config.yaml").exists():
            import yaml

            config = yaml.safe_load((self.run_dir / "config.yaml").read_text())
            write_hparams(logdir, config, {"loss/average": None, "time/step_s": None, "vram/peak_gib": None})


def pin_batches(accelerator: Any) -> str | None:
    """Have the training batches reach the GPU without stalling it: the next `accelerator.prepare` that gets a
    DataLoader (sd-scripts builds it inside train(), then prepares it right after the model) first sets the
    loader's `pin_memory` (its workers' batches land in page-locked memory) and accelerate's `non_blocking`
    (DataLoaderShard then queues the copies instead of waiting for each). Without it, a profile at `vram80`
    showed ~10 synchronous pageable copies per step, ~5 ms of an idle GPU. Returns the log line, or None off
    CUDA or where this accelerate has no dataloader configuration."""
    import torch

    device = getattr(accelerator, "device", None)
    config = getattr(accelerator, "dataloader_config", None)
    if getattr(device, "type", None) != "cuda" or not hasattr(config, "non_blocking"):
        return None
    original, own = accelerator.prepare, "prepare" in vars(accelerator)

    def prepare(*objects: Any, **kwargs: Any) -> Any:
        loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
        if loaders:  # once: the previous `prepare` from here on
            if own:
                accelerator.prepare = original
            else:
                del accelerator.prepare
            for loader in loaders:
                loader.pin_memory = True
            config.non_blocking = True
        return original(*objects, **kwargs)

    accelerator.prepare = prepare
    return f"batches: page-locked host memory, copied to {device} without waiting (train.pin_memory)"


def make_checkpoint_fit(memory: dict[str, Any], device: Any, kernels_installed: list[str]) -> Any:
    """memory.checkpoint_skip for this process (None where it has nothing to do: `0`, or no checkpointing)."""
    from flux_trainer.config.validate import CHECKPOINT_SKIP_AUTO as AUTO
    from flux_trainer.config.validate import checkpoint_skip_setting
    from flux_trainer.sdscripts.checkpoint_fit import CheckpointFit, DeviceMemory

    setting = checkpoint_skip_setting(memory.get("checkpoint_skip", 0))
    if setting == 0:
        return None
    blocked = memory.get("blocked") or None
    if setting == AUTO and not blocked and "cuda_graphs" in kernels_installed:
        blocked = "CUDA graphs record the blocks before the first step is measured"
    cuda = getattr(device, "type", str(device)) == "cuda"
    return CheckpointFit(
        setting,
        tier_gib=memory.get("tier_gib"),
        max_image_tokens=memory.get("max_image_tokens"),
        blocked=blocked,
        memory=DeviceMemory(device) if cuda else None,
    )


def alloc_retries_message(retries: float, step: int, fit: Any) -> str:
    """The card ran out of memory PyTorch could cache (warned once a run): what it costs and what frees memory."""
    kept = getattr(fit, "kept", 0)
    what = (
        f"memory.checkpoint_skip=0 (now {kept} blocks keep their activations), "
        if kept
        else "a lower memory tier (memory=vramNN with a smaller NN: more checkpointing, fp8 base, block swap), "
    )
    return (
        f"step {step}: PyTorch's allocator found no free memory {retries:.0f} time(s) since the last log and gave "
        "its whole cache back to the driver to retry (a device sync and a stall each time; TensorBoard "
        f"vram/alloc_retries): the card is at its memory limit and steps are slower for it. To free memory: {what}"
        "a smaller batch or resolution, or closing other programs on this GPU."
    )


def run_peak_gib(device: Any) -> float:
    """This process's peak allocated device memory since the last reset, in GiB (0 off CUDA)."""
    import torch

    if getattr(device, "type", "") != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


def tracker_writer(accelerator: Any) -> Any | None:
    """sd-scripts' TensorBoard writer (accelerate's tracker, unwrapped); None without one."""
    try:
        return accelerator.get_tracker("tensorboard", unwrap=True)
    except Exception:  # noqa: BLE001 - no tensorboard tracker configured
        return None


def tracker_logdir(accelerator: Any) -> str | None:
    """The directory of sd-scripts' TensorBoard tracker, so our texts land in the same run."""
    writer = tracker_writer(accelerator)
    try:
        return getattr(writer, "log_dir", None) or writer.get_logdir()
    except Exception:  # noqa: BLE001 - not a SummaryWriter (accelerate's blank tracker): no directory
        return None


def throttle_tracker_flush(accelerator: Any) -> bool:
    """sd-scripts' TensorBoard writer flushes at most every TENSORBOARD_FLUSH_SECS instead of at every step (see
    flux_trainer.metrics.tensorboard.throttle_flush); False without a TensorBoard tracker."""
    from flux_trainer.metrics.tensorboard import throttle_flush
    from flux_trainer.sdscripts.translate import TENSORBOARD_FLUSH_SECS

    writer = tracker_writer(accelerator)
    if not callable(getattr(writer, "flush", None)):
        return False
    return throttle_flush(writer, TENSORBOARD_FLUSH_SECS)


def device_name(device: Any) -> str:
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "cpu"


def make_step_metrics(args: Any, accelerator: Any, options: dict[str, Any]) -> Any:
    """Per-GPU numbers: one optimizer step sees batch x accumulation images and that many FLOPs."""
    from flux_trainer.metrics.flops import peak_bf16_tflops
    from flux_trainer.metrics.step import StepMetrics

    accum = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    name = device_name(accelerator.device)
    metrics = StepMetrics(
        device=accelerator.device,
        flops_per_step=float(options.get("flops_per_step", 0.0)) * accum,
        images_per_step=float(options.get("images_per_step", 1)) * accum,
        peak_tflops=peak_bf16_tflops(name) if name != "cpu" else None,
        processes=int(getattr(accelerator, "num_processes", 1) or 1),
    )
    metrics.start()
    return metrics
