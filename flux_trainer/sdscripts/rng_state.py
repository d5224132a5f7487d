"""The training process's random state, left to sd-scripts: a run draws what plain sd-scripts draws for the same TOMLs
(LoRA init, batch order, noise, timesteps), so `flux-train bench` can hold our run against plain sd-scripts' step by
step, and a resumed run still trains the steps the run would have trained without a stop.

sd-scripts seeds once (`set_seed(args.seed)` at the start of `train`) and then draws from the global generators:
torch's (the LoRA's init, the DataLoader's shuffle seed at each epoch, noise and timesteps every step), Python's and
NumPy's (the dataset's augmentations). Nothing here re-seeds; what is kept is only what a resume needs:

- `snapshot` / `restore`: every generator the step draws from (torch CPU and CUDA, NumPy, Python).
- `EpochOrder`: the training loader's sampler, watched. Each epoch it draws its order as the sampler it wraps would
  (from the global generator, at the same moment), and remembers the order and the generators before each batch was
  fetched. A state saves that (`STATE_FILE`); the resumed run hands out the rest of the saved epoch's order, fetches
  each batch from the generators it was fetched from, and puts the generators back as they were at the save before
  the event that came next (a fetch, the step, the next epoch), so the steps after the resume draw what the run
  would have drawn.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("flux_trainer.runner")
STATE_FILE = "flux_train_rng.pt"  # in a state folder: the generators and the epoch's batch order at the save


def snapshot() -> dict[str, Any]:
    """Every generator a training step draws from, as it is now (host copies; no device sync)."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():  # this process's device (accelerate set it); a seed set before CUDA started counts
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put the generators back as `snapshot` found them."""
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def untouched() -> Iterator[None]:
    """The generators as they were before the block, whatever it drew (a kernel's probe, its check)."""
    before = snapshot()
    try:
        yield
    finally:
        restore(before)


class EpochOrder:
    """Stands in for the training loader's sampler (`BatchSampler.sampler`): the same indices, drawn the same way and
    at the same moment, with what a state needs to replay the rest of the epoch recorded on the way.

    accelerate's loader fetches one batch ahead of the step (it looks for the epoch's end), and with no workers the
    fetch draws in this process (the dataset's augmentations; sd-scripts' bucket shuffle re-seeds Python's
    generator at an epoch's first fetch). So a state records, besides the order: the generators before each batch
    handed out but not yet trained was fetched, and the generators now, with the event they belong before: the next
    fetch ("fetch"), the next step ("step": the epoch's batches all fetched, or a stop honoured at a step's start) or
    the next epoch's loader ("epoch": the epoch all trained)."""

    def __init__(self, sampler: Any, trained: Any) -> None:
        self.sampler = sampler
        self.trained = trained  # () -> micro-batches this run has trained (a resumed run's included)
        self.order: list[int] = []  # this epoch's indices
        self.taken = 0  # indices of this epoch handed to the loader
        self.started = 0  # micro-batches trained before this epoch's first
        self.fetches: dict[int, dict[str, Any]] = {}  # position in the epoch (1-based) -> generators before its fetch
        self.replay: dict[str, Any] | None = None  # set by a resume: applied by the next epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:  # generator, data_source, num_samples ...: the wrapped sampler's
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __iter__(self) -> Iterator[int]:
        replay, self.replay = self.replay, None
        self.fetches = {}
        if replay is None:
            self.order, self.taken = [int(i) for i in self.sampler], 0  # the sampler's draws, all at its first index
            self.started = self.trained()
            fetches, before_next = {}, None
        else:  # the rest of the saved epoch, each batch fetched from the generators it was fetched from
            self.own_generator(replay)
            self.order, self.taken = [int(i) for i in replay["order"]], int(replay["trained"])
            self.started = self.trained() - self.taken
            fetches = replay["fetch"]
            before_next = replay["rng"] if replay["at"] == "fetch" else None
            next_fetch = int(replay["taken"]) + 1
        while self.taken < len(self.order):
            position = self.taken + 1
            if position in fetches:
                restore(fetches[position])
            elif before_next is not None and position == next_fetch:
                restore(before_next)
            self.fetches[position] = snapshot()
            for old in [p for p in self.fetches if p < position - 16]:  # only batches fetched ahead are asked for
                del self.fetches[old]
            self.taken = position
            yield self.order[position - 1]

    # ---- states ---------------------------------------------------------------------------------------------------
    def saved(self, at_step_start: bool) -> dict[str, Any]:
        """What a state saved now records. `at_step_start`: a stop honoured at the start of a step, its batch (and
        the one after) already fetched: the state is the one after the steps trained, before that step."""
        trained = self.trained() - self.started  # of this epoch
        if at_step_start or (self.taken == len(self.order) and trained < self.taken):
            at = "step"
        elif trained >= len(self.order):
            at = "epoch"
        else:
            at = "fetch"
        fetch = {p: s for p, s in self.fetches.items() if trained < p <= self.taken}
        generator = getattr(self.sampler, "generator", None)
        return {"order": self.order, "trained": trained, "taken": self.taken, "fetch": fetch, "rng": snapshot(),
                "at": at, "generator": generator.get_state() if generator is not None else None}  # fmt: skip

    def own_generator(self, saved: dict[str, Any]) -> None:
        """The sampler's own generator (accelerate gives it one, shared by the ranks, with several processes) as it
        was after the saved epoch's order was drawn: the epochs after it draw theirs as the run would have."""
        generator = getattr(self.sampler, "generator", None)
        if generator is not None and saved.get("generator") is not None:
            generator.set_state(saved["generator"])


def install(loader: Any, trained: Any) -> EpochOrder | None:
    """Put an `EpochOrder` in place of the prepared training loader's sampler (None where none is found)."""
    import torch.utils.data as tud

    base = getattr(loader, "base_dataloader", loader)
    owner = getattr(base, "batch_sampler", None)
    for _ in range(4):  # accelerate's BatchSamplerShard wraps the BatchSampler on several processes
        inner = getattr(owner, "sampler", None)
        if isinstance(inner, EpochOrder):
            return inner
        if isinstance(inner, tud.Sampler) and not isinstance(inner, tud.BatchSampler):
            order = EpochOrder(inner, trained)
            owner.sampler = order
            return order
        owner = getattr(owner, "batch_sampler", None)
    log.warning("the training loader's sampler was not found: a resumed run may not replay its batch order")
    return None


def write(folder: Path, record: dict[str, Any]) -> None:
    import torch

    torch.save(record, Path(folder) / STATE_FILE)


def read(folder: Path) -> dict[str, Any] | None:
    import torch

    path = Path(folder) / STATE_FILE
    if not path.is_file():
        return None
    return torch.load(path, weights_only=False)  # our own file, written by `write`
