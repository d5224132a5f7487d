"""Inside the training process: a resumed run continues where the state stopped, saves are all-or-nothing, and a
stop request ends the run after a whole step with a state saved.

sd-scripts 48d368fa loads a state's weights, optimizer, scheduler and random state, but then counts steps from 0
again (its `global_step` restarts unless `skip_until_initial_step`, which sets it to the step within the epoch), so
the progress, TensorBoard steps, state names and `max_train_steps` all restart. It also writes a state folder in
place, so a kill or a full disk mid-save leaves a folder that looks like a state. What this module does about it,
from our trainer subclass and a few reversible wrappers (no sd-scripts code changed):

- Steps. sd-scripts' global step `g` counts this process's steps; the run's step is `offset + g`, `offset` being
  the resumed state's step. Logging, sample images, state and LoRA names, `train_state.json` and the LoRA's
  `ss_steps` get the run's step; `max_train_steps` becomes `N - offset` once training starts (after the LR
  scheduler was built for N, so its schedule continues).
- Data and randomness. The run draws what plain sd-scripts draws (its one `set_seed`, then the global generators:
  LoRA init, each epoch's batch order, noise, timesteps), so our run and plain sd-scripts on the same TOMLs train the
  same steps. A state also records the epoch's batch order and the generators before the next batch (rng_state); the
  resumed run hands out the rest of that epoch's order and puts the generators back there, and the dataset's
  per-epoch bucket shuffles are replayed to that epoch: step k draws the same whether the run got there in one go or
  through any number of resumes.
- Saves. A state is written into `<name>.partial`, stamped with `flux_train_state.json` (its step and its files'
  sizes), synced, then renamed; a LoRA file likewise. A full disk removes the partial save and stops the run with
  the path, the free space and what to delete; the states already saved are untouched.
- Stops. With one process, the first SIGINT/SIGTERM lets the step in progress finish, saves a state (unless that
  step just saved one) and stops with "interrupted at step k"; a second stops at once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from flux_trainer.metrics.progress import say
from flux_trainer.sdscripts import rng_state

log = logging.getLogger("flux_trainer.runner")
STATE_MARKER = "flux_train_state.json"  # written last into a state: its step and files (complete when present)
PARTIAL = ".partial"  # a save in progress: `<final name>.partial`, renamed when complete
EXIT_DISK_FULL = 4


class DiskFull(RuntimeError):
    """A save ran out of disk space: the message names the path, the free space and what to do."""


def stopped(exc: BaseException, log: logging.Logger) -> tuple[int, str]:
    """(exit code, one-line reason) of a training process that ended on a stop request (`Interrupted`: after a whole
    step, a state saved), an interrupt before a step could finish (KeyboardInterrupt) or a full disk (`DiskFull`);
    logged. Both trainers' runners end this way."""
    if isinstance(exc, DiskFull):
        log.error("%s", exc)
        return EXIT_DISK_FULL, str(exc)
    if isinstance(exc, Interrupted):  # no traceback
        reason = str(exc)
    else:
        reason = f"interrupted ({exc or 'SIGINT'}) before a step could finish; resume=auto continues from the last "
        reason += "state saved"
    log.warning("%s", reason)
    return 130, reason


class Interrupted(RuntimeError):
    """A stop request was honoured at a step boundary; `step` is the last whole step (its state saved)."""

    def __init__(self, step: int, signame: str, saved: str | None):
        self.step, self.signame, self.saved = step, signame, saved
        where = f"; state saved: {saved}" if saved else ""
        super().__init__(f"interrupted at step {step} ({signame}){where}; resume=auto continues from there")


def state_step(state_dir: Path) -> tuple[int, int]:
    """(step, epoch) a state folder was saved at: our marker's, else sd-scripts' train_state.json's."""
    for name, key in ((STATE_MARKER, "step"), ("train_state.json", "current_step")):
        try:
            data = json.loads((Path(state_dir) / name).read_text(encoding="utf-8"))
            return int(data[key]), int(data.get("epoch", data.get("current_epoch", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return 0, 0


def free_space(path: Path) -> tuple[str, str]:
    """('12.3 GiB', mount point) of the filesystem holding `path` (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    mount = probe.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return f"{usage.free / 2**30:.1f} GiB", str(mount)


def is_disk_full(exc: BaseException, path: Path) -> bool:
    """Whether a failed write was the disk filling up: ENOSPC / EDQUOT, or torch's zip writer's RuntimeError
    ("file write failed") with under 64 MiB left where it wrote."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if "No space left" in text or "Disk quota exceeded" in text:
        return True
    if isinstance(exc, RuntimeError) and "write failed" in text:
        probe = Path(path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        return shutil.disk_usage(probe).free < 64 * 2**20
    return False


def _fsync_tree(folder: Path) -> dict[str, int]:
    """fsync every file under `folder` and the folders themselves; returns {relative path: size}."""
    sizes = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[str(path.relative_to(folder))] = path.stat().st_size
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return sizes


def _replace_dir(partial: Path, final: Path) -> None:
    """Rename `partial` to `final`; an existing `final` (the same name saved again) is moved aside first."""
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{os.getpid()}")
        final.rename(aside)
    partial.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


class Continuation:
    """One training process's share of the above. Built by the runner, driven by the trainer subclass's hooks."""

    def __init__(self, resume: str | None, seed: int | None, output_name: str, processes: int = 1) -> None:
        self.offset, self.resume_epoch = state_step(Path(resume)) if resume else (0, 0)
        self.seed = int(seed) if seed is not None else 42
        self.output_name = output_name
        self.processes = processes
        self.accumulation = 1
        self.micro = 0  # micro-batches this process has started
        self.max_steps: int | None = None  # the run's N (sd-scripts' max_train_steps before it is offset)
        self.loader: Any = None  # the prepared training DataLoader
        self.order: rng_state.EpochOrder | None = None  # its sampler, watched (batch order and generators per batch)
        self.fetched_ahead = False  # a stop honoured at a step's start: that step's batch is already fetched
        self.step_rng: dict | None = None  # a resume's generators as at the start of its first step
        self.accelerator: Any = None
        self.stop_signal: str | None = None
        self.in_loop = False
        self.last_saved: int | None = None  # the run step of the last state saved by this process
        self.newest_state: Path | None = None
        self.args: Any = None  # sd-scripts' args, from the first step on
        self.train_util: Any = None
        self._signals: dict[int, Any] = {}
        self._undo: list[Any] = []

    # ---- steps ----------------------------------------------------------------------------------------------
    def done(self) -> int:
        """Whole optimizer steps of the run so far (the resumed offset plus this process's)."""
        return self.offset + self.micro // self.accumulation

    def run_step(self, global_step: int) -> int:
        """sd-scripts' global step as the run's step."""
        return int(global_step) + self.offset

    # ---- install ----------------------------------------------------------------------------------------------
    def install(self, mods: Any) -> None:
        """Wrap the trainer's state and step-name functions for the run, and take SIGINT/SIGTERM (undone by
        `remove`). `mods`: sd-scripts' modules here; a subclass for another trainer takes what `wrap_names` needs."""
        self.wrap_names(mods)
        if self.processes == 1:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._signals[sig] = signal.signal(sig, self._on_signal)

    def wrap(self, module: Any, name: str, make: Any) -> None:
        """`module.name` replaced by `make(original)` until `remove`."""
        original = getattr(module, name)
        setattr(module, name, make(original))
        self._undo.append(lambda: setattr(module, name, original))

    def wrap_names(self, mods: Any) -> None:
        """sd-scripts' step names and stepwise state saves take the run's step (the part another trainer differs in;
        `self.train_util` is then the module whose `save_and_remove_state_stepwise(args, acc, step)` a stop calls)."""
        tu = self.train_util = mods.train_util
        offset = self.offset
        self.wrap(tu, "get_step_ckpt_name", lambda f: lambda args, ext, step_no: f(args, ext, step_no + offset))
        self.wrap(tu, "save_and_remove_state_stepwise", lambda f: lambda args, acc, n: f(args, acc, n + offset))
        self.wrap(tu, "get_remove_step_no", self.remove_no)

    def remove_no(self, f: Any) -> Any:
        """`get_remove_step_no(args, step_no)` (sd-scripts' and musubi-tuner's) in run steps; the step-name function
        adds the offset back."""
        offset = self.offset

        def get_remove_step_no(args: Any, step_no: int) -> int | None:
            r = f(args, step_no + offset)
            return None if r is None else r - offset

        return get_remove_step_no

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for sig, handler in self._signals.items():
            signal.signal(sig, handler)
        self._signals.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.in_loop or self.stop_signal is not None:
            raise KeyboardInterrupt(name)  # nothing to save yet, or asked twice: stop now
        self.stop_signal = name
        log.warning("%s: stopping after this step with a state saved (again to stop at once)", name)
        say(f"{name}: stopping after this step, with a state saved (again to stop at once)")

    def accelerator_ready(self, accelerator: Any) -> None:
        """sd-scripts made its Accelerator: atomic states, the batch order watched, the resume position on load. The
        loader keeps sd-scripts' sampler (no seedable one): its order is drawn as plain sd-scripts draws it."""
        if self.accelerator is accelerator:
            return
        self.accelerator = accelerator
        self.accumulation = max(1, int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1))
        save, load, prepare = accelerator.save_state, accelerator.load_state, accelerator.prepare
        own = {n: n in vars(accelerator) for n in ("save_state", "load_state", "prepare")}

        def save_state(output_dir: str | None = None, *a: Any, **kw: Any) -> Any:
            return self.save_atomically(Path(output_dir), lambda partial: save(str(partial), *a, **kw))

        def load_state(input_dir: str | None = None, *a: Any, **kw: Any) -> Any:
            result = load(input_dir, *a, **kw)
            self.position_loader(rng_state.read(Path(input_dir)) if input_dir else None)
            return result

        def prepared(*objects: Any, **kw: Any) -> Any:
            for obj in objects:
                if callable(getattr(obj, "save_weights", None)):
                    self.atomic_weights(obj)
            result = prepare(*objects, **kw)
            outs = result if isinstance(result, tuple) else (result,)
            loaders = [o for o in outs if hasattr(o, "skip_batches") and hasattr(o, "base_dataloader")]
            if loaders and self.loader is None:
                self.loader = loaders[0]  # sd-scripts passes the training loader before the validation one
                self.order = rng_state.install(self.loader, lambda: self.offset * self.accumulation + self.micro)
            return result

        accelerator.save_state, accelerator.load_state, accelerator.prepare = save_state, load_state, prepared

        def undo() -> None:
            for name, original in (("save_state", save), ("load_state", load), ("prepare", prepare)):
                if own[name]:
                    setattr(accelerator, name, original)
                else:
                    vars(accelerator).pop(name, None)

        self._undo.append(undo)

    # ---- resume position ------------------------------------------------------------------------------------
    def position_loader(self, saved: dict | None = None) -> None:
        """After a state loaded: the training loader starts at the state's epoch, with the rest of that epoch's batch
        order and the generators as they were before its next batch (`saved`: the state's rng_state record); the
        dataset's bucket order is replayed up to that epoch."""
        if not self.offset or self.loader is None:
            return
        batches = len(self.loader)
        per_epoch = max(1, math.ceil(batches / self.accumulation))
        epoch = self.offset // per_epoch
        skip = min((self.offset - epoch * per_epoch) * self.accumulation, batches)
        self.data_epoch(epoch, skip)
        if saved is not None and self.order is not None and saved["at"] == "epoch" and skip == 0:
            rng_state.restore(saved["rng"])  # the next epoch's loader is made, and its order drawn, from here
            self.order.own_generator(saved)
        elif saved is not None and self.order is not None and int(saved["trained"]) == skip:
            self.order.replay = saved  # the rest of the saved epoch
            if saved["at"] == "step":
                self.step_rng = saved["rng"]
        else:
            self.loader.skip_batches = skip  # a state without the record: a new order for this epoch
            log.warning("the state of step %d has no %s: the rest of its epoch is drawn anew", self.offset,
                        rng_state.STATE_FILE)  # fmt: skip
        text = f"resumed at step {self.offset}: epoch {epoch + 1} of the data, its first {skip} batches skipped"
        log.info("%s (already trained)", text)
        if self.processes == 1 or os.environ.get("RANK", "0") == "0":
            say(text)

    def data_epoch(self, epoch: int, skip: int) -> None:
        """The dataset's per-epoch bucket shuffles replayed up to the resumed epoch (0-based `epoch`, `skip` batches
        of it already trained). sd-scripts shuffles an epoch's buckets at that epoch's first fetch, re-seeding Python's
        generator (`random.seed(seed + epoch)`): a run stopped inside an epoch had that shuffle before its save, so
        the resumed epoch's own shuffle is replayed here too (`skip` > 0), with the generators untouched; otherwise its
        first fetch in this run shuffled again, re-seeding Python's generator after the fetch's own was put back, and
        trained another batch than the run never stopped (seen in the CPU resume test: stopped at steps 6 and 11, its
        step 12 read 1.2095 against 1.2700)."""
        dataset = getattr(self.loader, "dataset", None)
        if hasattr(dataset, "set_current_epoch"):
            with rng_state.untouched():
                dataset.set_current_epoch(epoch + 1 if skip else epoch)  # 1-based in sd-scripts' collator

    # ---- every micro-batch -----------------------------------------------------------------------------------
    def step_start(self, args: Any) -> None:
        """Before a training micro-batch: honour a stop request at a step boundary."""
        if not self.in_loop:
            self.in_loop, self.args = True, args
            if self.max_steps is None:  # a trainer whose loop reads it earlier set it before (musubi/continuation)
                self.max_steps = int(args.max_train_steps)
            if self.offset:
                args.max_train_steps = self.max_steps - self.offset  # sd-scripts' loop counts from 0
            if self.loader is not None:
                self.loader.skip_batches = 0  # skipped once; later epochs start at their beginning
        if self.stop_signal is not None and self.micro % self.accumulation == 0:
            self.stop_now()
        if self.step_rng is not None:
            rng_state.restore(self.step_rng)  # the state's: as the stopped run's step would have started
            self.step_rng = None
        self.micro += 1

    def stop_now(self) -> None:
        step = self.done()
        saved = None
        if step > self.offset and self.last_saved != step and self.accelerator is not None and self.args is not None:
            self.fetched_ahead = True  # this step's batch came out of the loader: the state is the one before it
            try:
                self.train_util.save_and_remove_state_stepwise(self.args, self.accelerator, step - self.offset)
            finally:
                self.fetched_ahead = False
        if self.last_saved == step and self.newest_state is not None:
            saved = str(self.newest_state)
        raise Interrupted(step, self.stop_signal or "stop", saved)

    # ---- saves ------------------------------------------------------------------------------------------------
    def save_atomically(self, final: Path, write: Any) -> Any:
        """Write a state into `<final>.partial` with `write(partial)`, stamp and sync it, rename it to `final`."""
        partial = final.with_name(final.name + PARTIAL)
        shutil.rmtree(partial, ignore_errors=True)
        step = self.done()
        try:
            result = write(partial)
            self._fix_train_state(partial, step)
            if self.order is not None:
                rng_state.write(partial, self.order.saved(self.fetched_ahead))
            sizes = _fsync_tree(partial)
            marker = {"step": step, "epoch": self._epoch_of(partial), "saved_at": time.time(), "files": sizes}
            (partial / STATE_MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
            _fsync_tree(partial)
            _replace_dir(partial, final)
        except BaseException as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(exc, Exception) and is_disk_full(exc, final):
                raise DiskFull(self._disk_full_message(final, exc)) from exc
            raise
        self.last_saved, self.newest_state = step, final
        return result

    def _fix_train_state(self, partial: Path, step: int) -> None:
        """sd-scripts wrote this process's step count: make it the run's step (its own loader reads it back)."""
        path = partial / "train_state.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        data["current_step"] = step
        path.write_text(json.dumps(data), encoding="utf-8")

    @staticmethod
    def _epoch_of(partial: Path) -> int:
        try:
            return int(json.loads((partial / "train_state.json").read_text(encoding="utf-8"))["current_epoch"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def _disk_full_message(self, final: Path, exc: BaseException) -> str:
        free, mount = free_space(final.parent)
        kept = f"the newest complete state is {self.newest_state}" if self.newest_state else "states saved before"
        return (
            f"disk full while saving {final}: {free} free on {mount} ({type(exc).__name__}: {exc}); nothing of "
            f"this save is left and {kept} is intact; free space (older runs under "
            f"{final.parent.parent}, or fewer kept states: train.save_last_n) and run again with resume=auto"
        )

    def run_metadata(self, metadata: dict) -> dict:
        """A resumed run's LoRA metadata in the run's terms: its steps."""
        if "ss_steps" in metadata:
            return {**metadata, "ss_steps": str(int(metadata["ss_steps"]) + self.offset)}
        return metadata

    def atomic_weights(self, network: Any) -> None:
        """The network's LoRA files appear only complete (written aside, synced, renamed), with the run's step."""
        if getattr(network, "_flux_train_atomic", False):
            return
        original = network.save_weights

        def save_weights(file: str, dtype: Any, metadata: dict | None) -> Any:
            if metadata is not None and self.offset:
                metadata = self.run_metadata(metadata)
            final = Path(file)
            # the extension stays last: sd-scripts picks safetensors or torch.save by it
            partial = final.with_name(f".{final.stem}{PARTIAL}{final.suffix}")
            try:
                result = original(str(partial), dtype, metadata)
                with open(partial, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(partial, final)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    partial.unlink()
                if isinstance(exc, Exception) and is_disk_full(exc, final):
                    raise DiskFull(self._disk_full_message(final, exc)) from exc
                raise
            return result

        network.save_weights = save_weights
        network._flux_train_atomic = True
