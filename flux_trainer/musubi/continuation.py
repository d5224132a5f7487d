"""Inside musubi-tuner's training process: resume, whole saves and a stop after a step, as on sd-scripts' side.

flux_trainer.sdscripts.continuation does the work (the step offset, atomic stamped states and LoRA files, the batch
order replayed, SIGINT/SIGTERM honoured at a step boundary); this is the part where musubi-tuner 30c658c4 differs:

- Its state helpers (`musubi_tuner.utils.train_utils`) name states as sd-scripts does but take other arguments:
  `get_step_ckpt_name(model_name, step_no)`, `get_epoch_ckpt_name(model_name, epoch_no)`, the epoch saves. They are
  wrapped to take the run's step and epoch.
- It writes no train_state.json: our stamp is the only record of a state's step.
- Its loop restarts `global_step` and the epoch at 0 after `accelerator.load_state(args.resume)`, and computes its
  number of epochs from `max_train_steps` right after `on_train_start`. So from `on_train_start` on,
  `max_train_steps` is the steps from the resumed epoch's start (the epochs come out right, the first one being the
  rest of the resumed epoch), and from the first step on, the steps left (its loop stops at N).
- Its step logs go through `accelerator.log(logs, step=global_step)` (wrapped: the run's step) and its epoch counter
  is a shared `multiprocessing.Value` the loop sets to `epoch + 1` and the dataset reads to reshuffle its buckets
  (`EpochCounter`: the run's epoch). The buckets' shuffles up to the resumed epoch are replayed before the loop, with
  the generators put back, so the rest of the epoch is the stopped run's.
"""

from __future__ import annotations

import math
from typing import Any

from flux_trainer.sdscripts import rng_state
from flux_trainer.sdscripts.continuation import Continuation


class EpochCounter:
    """Stands in for musubi-tuner's shared epoch Value in its training loop: the loop sets the epoch of this process
    (1-based), the dataset and collator read the run's (the shared Value itself, which this writes)."""

    def __init__(self, shared: Any, continuation: MusubiContinuation) -> None:
        self.shared, self.continuation = shared, continuation

    @property
    def value(self) -> int:
        return int(self.shared.value) - self.continuation.epoch_offset

    @value.setter
    def value(self, epoch: int) -> None:
        self.shared.value = int(epoch) + self.continuation.epoch_offset


class MusubiContinuation(Continuation):
    """`Continuation` with musubi-tuner's state helpers, loop and epoch counter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_offset = 0  # whole epochs of the run before this process's first
        self.step_log = False  # the next accelerator.log is a step's (musubi-tuner's extra_step_logs came first)

    def wrap_names(self, train_utils: Any) -> None:
        """musubi-tuner's `train_utils` module: step and epoch names and saves in the run's numbers."""
        self.train_util = train_utils
        offset = self.offset
        self.wrap(train_utils, "get_step_ckpt_name", lambda f: lambda name, step_no: f(name, step_no + offset))
        self.wrap(train_utils, "save_and_remove_state_stepwise", lambda f: lambda a, acc, n: f(a, acc, n + offset))
        self.wrap(train_utils, "get_remove_step_no", self.remove_no)
        self.wrap(train_utils, "get_epoch_ckpt_name", lambda f: lambda name, n: f(name, n + self.epoch_offset))
        epoch_save = "save_and_remove_state_on_epoch_end"
        self.wrap(train_utils, epoch_save, lambda f: lambda a, acc, n: f(a, acc, n + self.epoch_offset))

        def remove_epoch_no(f: Any) -> Any:
            def get_remove_epoch_no(args: Any, epoch_no: int) -> int | None:
                r = f(args, epoch_no + self.epoch_offset)
                return None if r is None else r - self.epoch_offset

            return get_remove_epoch_no

        self.wrap(train_utils, "get_remove_epoch_no", remove_epoch_no)

    def accelerator_ready(self, accelerator: Any) -> None:
        """Besides the base's: the step logs at the run's step, the epoch logs at the run's epoch."""
        first = self.accelerator is not accelerator
        super().accelerator_ready(accelerator)
        if not first:
            return
        log, own = accelerator.log, "log" in vars(accelerator)

        def run_log(values: dict, step: int | None = None, **kw: Any) -> Any:
            if step is not None and self.step_log:
                step = self.run_step(step)
            elif step is not None and "loss/epoch" in values:
                step = int(step) + self.epoch_offset
            self.step_log = False
            return log(values, step=step, **kw)

        accelerator.log = run_log
        self._undo.append(lambda: setattr(accelerator, "log", log) if own else vars(accelerator).pop("log", None))

    def data_epoch(self, epoch: int, skip: int) -> None:
        """The dataset's bucket shuffles of the epochs before (and, `skip` > 0, of the resumed one, which the stopped
        run had drawn before its save), replayed now with the generators untouched; the loop's epochs count on."""
        self.epoch_offset = epoch
        upto = epoch + 1 if skip else epoch  # the dataset's epochs are 1-based; the next one shuffles at its fetch
        for dataset in getattr(getattr(self.loader, "dataset", None), "datasets", []):
            with rng_state.untouched():
                while dataset.current_epoch < upto:
                    dataset.current_epoch += 1
                    dataset.shuffle_buckets()

    def train_start(self, args: Any) -> None:
        """musubi-tuner's `on_train_start`: its loop computes its epochs from `max_train_steps` next."""
        self.max_steps = int(args.max_train_steps)
        if self.offset and self.loader is not None:
            per_epoch = max(1, math.ceil(len(self.loader) / self.accumulation))
            args.max_train_steps = self.max_steps - self.epoch_offset * per_epoch

    def run_metadata(self, metadata: dict) -> dict:
        """The LoRA's steps, epoch and planned steps in the run's terms."""
        out = super().run_metadata(metadata)
        if "ss_epoch" in out:
            out = {**out, "ss_epoch": str(int(out["ss_epoch"]) + self.epoch_offset)}
        if "ss_max_train_steps" in out and self.max_steps is not None:
            out = {**out, "ss_max_train_steps": str(self.max_steps)}
        return out
