"""One training run, start to end: validate, resolve for this machine, write the run dir, launch.

`train(cfg, run_dir)` is what `flux-train` calls inside Hydra and what tests call directly. Everything it
decides is written to the run dir before the child starts: config.yaml, sd_scripts.toml, dataset.toml,
accelerate.yaml, env.json, runner.json, command.txt; the child's output goes to train.log.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flux_trainer.backend import MUSUBI, SDSCRIPTS, TRAINER_NAMES
from flux_trainer.backend.samples import SAMPLE_FILE, prompts_text
from flux_trainer.config import ConfigError
from flux_trainer.config.paths import cache_root, model_cache
from flux_trainer.config.validate import tier_gib
from flux_trainer.data import stage as data_stage
from flux_trainer.data.subsets import largest_resolution
from flux_trainer.launch import command as launch_command
from flux_trainer.launch import device as launch_device
from flux_trainer.launch import profiles, rundir
from flux_trainer.plan import cuda_graphs_note, processes, resolve
from flux_trainer.sdscripts import checkout as sd_checkout
from flux_trainer.sdscripts.parser_schema import check_training_keys, load_schema
from flux_trainer.sdscripts.resume import SavedState, resume_decision
from flux_trainer.sdscripts.runner import RunnerSpec
from flux_trainer.sdscripts.translate import RunPaths, tracker_document, translate

log = logging.getLogger("flux_trainer")


def say(msg: str) -> None:
    print(f"[flux-train] {msg}", flush=True)


def checkpoint_skip_spec(cfg: DictConfig) -> dict:
    """memory.checkpoint_skip for the training process: the setting ("0" without checkpointing), the tier's size
    (auto never plans past it, on a larger card too), why auto must leave every block checkpointed, and the largest
    bucket's image tokens (auto scales what it measured on a smaller first batch up to it)."""
    mem = cfg.memory
    if not mem.gradient_checkpointing:
        return {"checkpoint_skip": "0"}
    blocked = None
    if mem.blocks_to_swap:
        blocked = "memory.blocks_to_swap: this tier already trades speed for memory"
    elif mem.cpu_offload_checkpointing:
        blocked = "memory.cpu_offload_checkpointing: this tier already trades speed for memory"
    resolution = largest_resolution(cfg.dataset)
    return {
        "checkpoint_skip": str(mem.checkpoint_skip).strip().lower(),
        "tier_gib": tier_gib(mem.tier),
        "blocked": blocked,
        # the largest bucket: area <= resolution², one image token per 16x16 pixels (8x VAE, 2x2 patches)
        "max_image_tokens": resolution * resolution // 256,
    }


@dataclass
class Prepared:
    run_dir: Path
    command: list[str]
    env: dict[str, str]
    checkout: sd_checkout.Checkout | None
    random_preset: str | None
    env_lines: list[str]
    lock: rundir.OutputLock | None = None  # runs/<output_name>/ held while the run is live
    device: Any = None  # the card planned for (launch.device.DeviceInfo): the detected one, or hardware=NAME's
    backend: str = SDSCRIPTS  # the trainer (flux_trainer.backend)


def prepare(
    cfg: DictConfig, run_dir: Path, *, search_dirs: list[Path] | None = None, info=None, exclusive: bool = True
) -> Prepared:
    """Validate, resolve and write the run dir. Raises ConfigError (and leaves no run dir) on bad input.
    `exclusive`: hold runs/<output_name>/ for the run (a second live run of the name is refused; sweep members,
    whose run dirs are the sweep's, do not)."""
    info = info or launch_device.detect_device()
    plan = resolve(cfg, info, search_dirs=search_dirs)
    info = plan.device  # hardware=NAME: the named card (dry_run), else the detected one
    for line in plan.said:
        say(line)
    if plan.backend == MUSUBI:
        return _prepare_musubi(cfg, plan, run_dir, exclusive)
    try:
        checkout = sd_checkout.locate(cfg.sd_scripts)
    except ConfigError:
        if not cfg.dry_run:
            raise
        checkout = None
        say("warning: no sd-scripts checkout: the TOMLs are checked against the committed parser schema only")
    if checkout is not None and (msg := sd_checkout.commit_warning(checkout)):
        say(f"warning: {msg}")

    # every image and caption checked, then staged in the cache (sd-scripts' caches land there, not beside them)
    te_fp8 = bool(cfg.memory.get("t5xxl_fp8"))
    staged_images, notes = data_stage.ready_all(cfg.dataset, cfg.model, cache_root(), int(cfg.train.batch_size), te_fp8)
    for note in notes:
        say(f"note: {note}")
    runs_root = plan.runs_root
    lock = rundir.lock_output(runs_root / cfg.train.output_name) if exclusive else None
    run_dir, made = run_dir.resolve(), False
    try:
        run_dir, made = rundir.claim_run_dir(run_dir, command=sys.argv), True
        state = resume_state(cfg, runs_root)
        if not cfg.dry_run:
            preflight_doctor(cfg, info)
        paths = RunPaths(
            run_dir=run_dir,
            tokenizer_dir=plan.tokenizer_dir,
            sample_prompts=run_dir / SAMPLE_FILE if cfg.sample.prompts else None,
            resume_state=state.path if state is not None else None,
            tracker_config=run_dir / "tracker.toml" if cfg.logging.tensorboard else None,
            images=tuple(staged_images),
        )
        train_doc, dataset_doc = translate(cfg, paths)
        problems = check_training_keys(train_doc.flat(), load_schema()["flags"])
        if problems:
            raise ConfigError(problems)

        profile = profiles.environment_profile(info, os.environ, gpus=plan.gpus, cache_dir=cache_root())
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        train_toml, dataset_toml = run_dir / "sd_scripts.toml", run_dir / "dataset.toml"
        train_toml.write_text(train_doc.dumps(), encoding="utf-8")
        dataset_toml.write_text(dataset_doc.dumps(), encoding="utf-8")
        if paths.sample_prompts:
            paths.sample_prompts.write_text(prompts_text(cfg), encoding="utf-8")
        if paths.tracker_config:
            paths.tracker_config.write_text(tracker_document().dumps(), encoding="utf-8")
        if checkout is not None:
            from flux_trainer.sdscripts import live_check

            # what importing sd-scripts prints goes to the run's log, as all of sd-scripts' output does
            with open(run_dir / "train.log", "a", encoding="utf-8") as log, _quietly(log):
                problems = live_check.checked(
                    lambda: sd_checkout.import_sd_scripts(checkout.path),
                    checkout.path,
                    train_toml,
                    dataset_toml,
                    run_dir,
                    cache_root() / live_check.CACHE_FILE,
                )
            if problems:
                raise ConfigError(problems)
        accel_path = run_dir / "accelerate.yaml"
        accel_path.write_text(OmegaConf.to_yaml(OmegaConf.create(launch_command.accelerate_config(cfg, info))))
        (run_dir / "env.json").write_text(json.dumps(profiles.profile_json(profile, info), indent=1) + "\n")
        random_preset = cfg.model.get("random_preset")
        spec = RunnerSpec(
            sd_scripts=str(checkout.path) if checkout else "",
            train_toml=str(train_toml),
            dataset_toml=str(dataset_toml),
            random_model_dir=str(Path(cfg.model.flux).parent) if _custom_loader(random_preset) else None,
            kernels=plan.kernels.for_runner(),
            metrics={"enabled": cfg.logging.tensorboard, **_flops_options(cfg), **_profile_options(cfg)},
            tf32=profile.env.get("FLUX_TRAIN_TF32") == "1",
            pin_memory=bool(cfg.train.pin_memory),
            staged_copy=bool(cfg.train.staged_copy),
            sync_free=bool(cfg.train.sync_free),
            memory=checkpoint_skip_spec(cfg),
            t5xxl_fp8=bool(cfg.memory.get("t5xxl_fp8")),
        )
        spec.write(run_dir)
        cmd = launch_command.launch_command(
            cfg, run_dir=run_dir, accelerate_config_path=accel_path, runner_args=["--run-dir", str(run_dir)], info=info
        )
        (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    except BaseException:
        parents = (run_dir.parent, runs_root) if exclusive else ()
        rundir.remove_refused(run_dir, made, parents)  # nothing of a refused run is left
        if lock is not None:
            lock.release()
        raise
    env = {**os.environ, **profile.env}
    return Prepared(run_dir, cmd, env, checkout, random_preset, profiles.profile_lines(profile), lock, info)


def resume_state(cfg: DictConfig, runs_root: Path) -> SavedState | None:
    """The state `resume=` continues from, for either trainer (None: start fresh); FinishedRun when `resume=auto`
    finds the output name's newest state at train.max_steps already."""
    if cfg.resume == "auto":
        decision = resume_decision(runs_root, cfg.train.output_name, cfg.train.max_steps)
        for line in decision.skipped:
            say(line)
        say(decision.sentence)
        if decision.finished:
            raise FinishedRun(decision.sentence)
        return decision.state
    if cfg.resume != "off":  # a folder named by hand: its step is read in the training process
        return SavedState(Path(cfg.resume).expanduser().resolve(), step=-1, final=False)
    return None


def _prepare_musubi(cfg: DictConfig, plan, run_dir: Path, exclusive: bool) -> Prepared:
    """prepare() for a model that trains on musubi-tuner (FLUX.2, Kontext): the same run dir, launch and rollback,
    musubi-tuner's files (flux_trainer.musubi.run)."""
    from flux_trainer.musubi import run as musubi_run

    info = plan.device
    say(musubi_run.kernels_line(cfg))
    checkout, lines = musubi_run.locate(cfg, bool(cfg.dry_run))
    for line in lines:
        say(line)
    staged_images, notes = data_stage.ready_all(cfg.dataset, cfg.model, cache_root(), int(cfg.train.batch_size))
    for note in notes:
        say(f"note: {note}")
    folders = musubi_run.stage_dataset(cfg, staged_images)
    runs_root = plan.runs_root
    lock = rundir.lock_output(runs_root / cfg.train.output_name) if exclusive else None
    run_dir, made = run_dir.resolve(), False
    try:
        run_dir, made = rundir.claim_run_dir(run_dir, command=sys.argv), True
        state = resume_state(cfg, runs_root)
        if not cfg.dry_run:
            preflight_doctor(cfg, info)
        profile = profiles.environment_profile(info, os.environ, gpus=plan.gpus, cache_dir=cache_root())
        musubi_run.write_config(cfg, run_dir)
        resume = state.path if state is not None else None
        # what importing musubi-tuner prints (its live check) goes to the run's log, as all of its output does
        with open(run_dir / "train.log", "a", encoding="utf-8") as log_file, _quietly(log_file):
            files = musubi_run.write_files(cfg, run_dir, folders, checkout, resume)
        for line in files.said:
            say(line)
        accel_path = run_dir / "accelerate.yaml"
        accel_path.write_text(OmegaConf.to_yaml(OmegaConf.create(launch_command.accelerate_config(cfg, info))))
        (run_dir / "env.json").write_text(json.dumps(profiles.profile_json(profile, info), indent=1) + "\n")
        cmd = launch_command.launch_command(
            cfg,
            run_dir=run_dir,
            accelerate_config_path=accel_path,
            runner_args=["--run-dir", str(run_dir)],
            info=info,
            module=musubi_run.RUNNER_MODULE,
        )
        (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    except BaseException:
        parents = (run_dir.parent, runs_root) if exclusive else ()
        rundir.remove_refused(run_dir, made, parents)
        if lock is not None:
            lock.release()
        raise
    env = {**os.environ, **profile.env}
    random_preset = cfg.model.get("random_preset")
    return Prepared(run_dir, cmd, env, checkout, random_preset, profiles.profile_lines(profile), lock, info, MUSUBI)


def _custom_loader(random_preset: str | None) -> bool:
    """A random preset narrower than sd-scripts' loaders can build (random_tiny, random_chroma_tiny)."""
    from flux_trainer.config.random_specs import PRESETS, needs_custom_loader

    return bool(random_preset) and needs_custom_loader(PRESETS[random_preset])


def preflight_doctor(cfg: DictConfig, info) -> None:
    """`flux-train doctor`'s fast subset (no GPU kernels, about a second): stop on any fail, before a model loads.
    Random presets' files are generated after this, so their model rows are not judged here."""
    from flux_trainer.doctor import fast_checks

    random = bool(cfg.model.get("random_preset"))
    fails = [r for r in fast_checks(cfg, info) if r.status == "fail" and not (random and r.group == "models")]
    if fails:
        raise ConfigError([f"doctor: {r.check}: {r.evidence}; fix: {r.fix}" for r in fails])


class FinishedRun(Exception):
    """resume=auto found the run already complete: nothing to do (exit 0)."""


def _profile_options(cfg: DictConfig) -> dict:
    snapshot = cfg.logging.get("memory_snapshot_at")
    out = {} if snapshot is None else {"memory_snapshot_at": int(snapshot)}
    at = cfg.logging.get("profile_at")
    if at is None:
        return out
    python = bool(cfg.logging.get("profile_python", False))
    return {**out, "profile_at": int(at), "profile_steps": int(cfg.logging.profile_steps), "profile_python": python}


def _flops_options(cfg: DictConfig) -> dict:
    """FLOPs of one step for throughput/tflops (the random tiny preset's shapes differ from FLUX.1-dev)."""
    try:
        from flux_trainer.config.random_specs import PRESETS
        from flux_trainer.metrics.flops import flux_step_flops, img_tokens_for
    except ImportError:
        return {}
    shape = PRESETS.get(cfg.model.get("random_preset") or "full", PRESETS["full"])["flux"]
    res = largest_resolution(cfg.dataset)
    flops = flux_step_flops(
        hidden=shape["hidden_size"],
        depth=shape["depth"],
        depth_single=shape["depth_single_blocks"],
        mlp_ratio=shape["mlp_ratio"],
        img_tokens=img_tokens_for(res, res),
        txt_tokens=int(cfg.model.t5xxl_max_token_length or (256 if cfg.model.name == "flux_schnell" else 512)),
        batch=int(cfg.train.batch_size),
        lora_rank=int(cfg.network.rank),
        gradient_checkpointing=bool(cfg.memory.gradient_checkpointing),
    )
    return {"flops_per_step": flops.total, "images_per_step": int(cfg.train.batch_size)}


def train(
    cfg: DictConfig, run_dir: Path, *, search_dirs: list[Path] | None = None, info=None, exclusive: bool = True
) -> int:
    """Prepare the run dir and, unless dry_run, launch the training child. Returns the exit code."""
    began = time.time()
    try:
        prepared = prepare(cfg, run_dir, search_dirs=search_dirs, info=info, exclusive=exclusive)
    except FinishedRun:
        return 0  # prepare removed the run dir: nothing to put in it
    try:
        return _launch(cfg, prepared, began, prepared.device or info)
    finally:
        if prepared.lock is not None:
            prepared.lock.release()


@contextlib.contextmanager
def _quietly(log):
    """File descriptors 1 and 2 (print, logging handlers made earlier, C code alike) to `log` for the block, unless
    -v. Only where nothing else is writing: before the training child and its readers start."""
    if _verbose():
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        yield
    finally:  # the terminal back whatever happened; nothing here can fail after the dups above succeeded
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _verbose() -> bool:
    return os.environ.get("FLUX_TRAIN_VERBOSE", "") not in ("", "0")


def _launch(cfg: DictConfig, prepared: Prepared, began: float, info) -> int:
    """The header, the training child (its output to train.log, one progress line on the terminal), the summary."""
    from flux_trainer.commands.sweep import effective_batch_line

    info = info or launch_device.detect_device()
    root = Path(cfg.logging.root).resolve()
    say(f"run dir: {prepared.run_dir}")
    steps = f"{cfg.train.max_steps} steps" if cfg.train.max_steps else f"{cfg.train.max_epochs} epochs"
    batch = effective_batch_line(cfg, max(processes(cfg, info), 1) * int(cfg.launcher.nodes))
    say(f"{cfg.model.name} on {info.name}: memory={cfg.memory.tier}, kernels={cfg.kernels.set}, {steps}; {batch}")
    if prepared.backend != MUSUBI and (note := cuda_graphs_note(cfg, gpu=info.is_gpu)):
        say(note)
    log_lines = ["environment (env.json): " + "; ".join(prepared.env_lines)]
    if cfg.dry_run:
        say(log_lines[0])
        if str(cfg.hardware.get("name", "auto")) != "auto" and info.is_gpu:  # the named card: what it would run
            from flux_trainer.doctor.gpu import kernels_for_card
            from flux_trainer.musubi import run as musubi_run

            only = musubi_run.planned_kernels(cfg) if prepared.backend == MUSUBI else None
            say(kernels_for_card(info, only).evidence)
        trainer_toml = "musubi_tuner.toml" if prepared.backend == MUSUBI else "sd_scripts.toml"
        say(f"dry_run=true: wrote config.yaml, {trainer_toml}, dataset.toml, command.txt; not launching")
        say(f"would run: {shlex.join(prepared.command)}")
        return 0
    if prepared.random_preset:
        device = "cuda" if info.family != "cpu" else "cpu"
        _ensure_random_model(prepared.backend, model_cache(cfg.model_cache), prepared.random_preset, device)
    from flux_trainer.backend.exit_record import child_exit_code, child_reason
    from flux_trainer.launch.direct import direct_command
    from flux_trainer.launch.supervise import run_supervised
    from flux_trainer.metrics.progress import ProgressView
    from flux_trainer.metrics.startup import launch_env

    say(f"TensorBoard: tensorboard --logdir {root}")
    log_path = prepared.run_dir / "train.log"
    command, env, via = prepared.command, prepared.env, "accelerate launch"
    if cfg.launcher.get("direct", True) and (direct := direct_command(command, env)) is not None:
        (command, env), via = direct, "process start"
        log_lines.append("one process: started with accelerate's environment, without its launcher (launcher.direct)")
        with open(prepared.run_dir / "command.txt", "a", encoding="utf-8") as f:
            f.write(f"# launcher.direct: the same process started as {shlex.join(command)} with accelerate's env\n")
    verbose = _verbose()
    with open(log_path, "a", encoding="utf-8") as log:
        log.writelines(f"[flux-train] {line}\n" for line in log_lines)
    if verbose:
        for line in log_lines:
            say(line)
    else:
        say(f"training; {TRAINER_NAMES[prepared.backend]}'s output goes to {log_path} (-v shows it here)")
    view = ProgressView(echo=sys.stdout, tty=sys.stdout.isatty(), draw=not verbose)
    code = run_supervised(
        command,
        {**env, **launch_env(began, via=via)},  # when this command began and started the child: the start-up line
        log_path,
        memory_tier=cfg.memory.tier,
        exit_code=functools.partial(child_exit_code, prepared.run_dir),
        pass_fds=() if prepared.lock is None else (prepared.lock.fd,),  # the child holds the name's lock too
        graceful=via == "process start",  # one training process: Ctrl-C ends it after a step, with a state saved
        reason=functools.partial(child_reason, prepared.run_dir),
        view=view,
        quiet=not verbose,
    )
    if code == 0:
        final = prepared.run_dir / f"{cfg.train.output_name}.safetensors"
        done = view.summary()
        say(f"done in {_took(time.time() - began)}" + (f": {done}" if done else ""))
        if prepared.backend == MUSUBI and final.is_file():
            from flux_trainer.musubi.lora_format import summary_lines

            for line in summary_lines(final, str(cfg.model.model_type)):
                say(line)
        else:
            say(f"LoRA: {final if final.is_file() else '(none written)'}")
        say(f"log: {log_path}; TensorBoard: tensorboard --logdir {root}")
    return code


def _ensure_random_model(backend: str, cache: Path, preset: str, device: str) -> None:
    """A random preset's files, generated once into the model cache by its backend's generator."""
    if backend == MUSUBI:
        from flux_trainer.musubi.random_model import ensure_random_musubi_model

        ensure_random_musubi_model(cache, preset, device=device, log=say)
        return
    from flux_trainer.sdscripts.random_model import ensure_random_model

    ensure_random_model(cache, preset, device=device, log=say)


def _took(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"
