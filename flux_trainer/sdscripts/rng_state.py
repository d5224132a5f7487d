"""The training process's random state, left to sd-scripts: a run draws what plain sd-scripts draws for the same TOMLs
(LoRA init, batch order, noise, timesteps), so `flux-train bench` can hold our run against plain sd-scripts' step by
step, and a resumed run still trains the steps the run would have trained without a stop.

sd-scripts seeds once (`set_seed(args.seed)` at the start of `train`) and then draws from the global generators:
torch's (the LoRA's init, the DataLoader's shuffle seed at each epoch, noise and timesteps every step), Python's and
NumPy's (the dataset's augmentations). Nothing here re-seeds; what is kept is only what a resume needs:

- `snapshot` / `restore`: every generator the step draws from (torch CPU and CUDA, NumPy, Python).
- `EpochOrder`: the training loader's sampler, watched. Each epoch it draws its order as the sampler it wraps would
  (from the global generator, at the same moment), and remembers the order and the state before each batch was
  fetched. A state saves that (`STATE_FILE`); the resumed run hands out the rest of the saved epoch's order and puts
  the generators back where they were before the next batch was fetched, so the steps after the resume draw what
  the run would have drawn.
"""

from __future__ import annotations

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
    if torch.cuda.is_available():  # a seed set before CUDA started is applied first: the state the step will draw
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put the generators back as `snapshot` found them."""
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class EpochOrder:
    """Stands in for the training loader's sampler (`BatchSampler.sampler`): the same indices, drawn the same way and
    at the same moment, with what a state needs to replay the rest of the epoch recorded on the way."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.order: list[int] = []  # this epoch's indices
        self.taken = 0  # indices of this epoch handed to the loader
        self.entry: dict[str, Any] | None = None  # the generators before this epoch's order was drawn
        self.before_last: dict[str, Any] | None = None  # ... before the last index was handed out (its batch fetched)
        self.replay: dict[str, Any] | None = None  # set by a resume: applied by the next epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:  # generator, data_source, num_samples ...: the wrapped sampler's
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __iter__(self) -> Iterator[int]:
        replay, self.replay = self.replay, None
        if replay is not None and replay.get("entry"):  # the epoch starts where the saved run's did
            restore(replay["rng"])
            replay = None
        self.entry = snapshot()
        if replay is None:
            self.order, self.taken = [int(i) for i in self.sampler], 0  # the sampler's draws, all at its first index
            pending = None
        else:  # the rest of the saved epoch, the generators as they were before its next batch was fetched
            self.order, self.taken, pending = [int(i) for i in replay["order"]], int(replay["taken"]), replay["rng"]
        while self.taken < len(self.order):
            if pending is not None:
                restore(pending)
                pending = None
            self.before_last = snapshot()
            self.taken += 1
            yield self.order[self.taken - 1]

    # ---- states ---------------------------------------------------------------------------------------------------
    def saved(self, fetched_ahead: bool, workers: int) -> dict[str, Any]:
        """What a state saved now records. `fetched_ahead`: the next step's batch was already fetched (a stop request
        honoured at the start of that step): the state is the one before that fetch."""
        if fetched_ahead and self.taken == 1 and self.entry is not None:
            return {"entry": True, "rng": self.entry}  # that batch began an epoch: replay the epoch's own draw
        if fetched_ahead and workers == 0 and self.before_last is not None:
            return {"entry": False, "order": self.order, "taken": self.taken - 1, "rng": self.before_last}
        return {"entry": False, "order": self.order, "taken": self.taken, "rng": snapshot()}


def install(loader: Any) -> EpochOrder | None:
    """Put an `EpochOrder` in place of the prepared training loader's sampler (None where none is found)."""
    import torch.utils.data as tud

    base = getattr(loader, "base_dataloader", loader)
    owner = getattr(base, "batch_sampler", None)
    for _ in range(4):  # accelerate's BatchSamplerShard wraps the BatchSampler on several processes
        inner = getattr(owner, "sampler", None)
        if isinstance(inner, EpochOrder):
            return inner
        if isinstance(inner, tud.Sampler) and not isinstance(inner, tud.BatchSampler):
            order = EpochOrder(inner)
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
