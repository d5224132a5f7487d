"""Find the state `resume=auto` continues from: the newest complete state of any run dir of the output name.

sd-scripts saves accelerate states as `<output_name>-step00000250-state`, `<output_name>-000003-state` (epochs)
and `<output_name>-state` (end of training), each with a `train_state.json` holding `current_step`. flux-train
writes each into `<name>.partial` first and stamps it with `flux_train_state.json` (its step, when it was saved,
its files and their sizes) before renaming it (flux_trainer.sdscripts.continuation). A state is complete when its
stamp's files are all there at their sizes; a state from before the stamp (or copied by hand) is checked file by
file. Anything else is skipped with one line naming it, and the newest good one is used.

Live runs: a run holds its output name's folder locked while it trains (flux_trainer.launch.rundir), and
`resume=auto` runs with that lock held, so no state found here belongs to a run that may still write it.
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from flux_trainer.sdscripts.continuation import PARTIAL, STATE_MARKER


@dataclass(frozen=True)
class SavedState:
    path: Path
    step: int
    final: bool  # saved at the end of training
    saved_at: float = 0.0  # when (the stamp's time, else train_state.json's modification time)


def _safetensors_problem(path: Path) -> str | None:
    """Whether a .safetensors file holds all the bytes its header says it has."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as exc:
        return f"{path.name} is unreadable ({type(exc).__name__})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if path.stat().st_size < 8 + n + end:
        return f"{path.name} is truncated"
    return None


def _zip_problem(path: Path) -> str | None:
    """torch.save writes a zip: a truncated one has no central directory, a damaged member fails its CRC."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        return f"{path.name} is unreadable ({type(exc).__name__})"
    return f"{path.name} is damaged ({bad})" if bad else None


def state_problem(folder: Path) -> str | None:
    """Why `folder` is not a complete, readable state (None: it is)."""
    marker = folder / STATE_MARKER
    if marker.is_file():
        try:
            files = json.loads(marker.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{STATE_MARKER} is unreadable"
        for name, size in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} when saved"
        return None
    try:
        json.loads((folder / "train_state.json").read_text(encoding="utf-8"))["current_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return "train_state.json is missing or unreadable"
    weights = [p for p in (folder / "model.safetensors", folder / "pytorch_model.bin") if p.is_file()]
    if not weights:
        return "no network weights (model.safetensors / pytorch_model.bin)"
    if not (folder / "optimizer.bin").is_file():
        return "optimizer.bin is missing"
    for path in sorted(folder.iterdir()):
        problem = None
        if path.stat().st_size == 0:
            problem = f"{path.name} is empty"
        elif path.suffix == ".safetensors":
            problem = _safetensors_problem(path)
        elif path.suffix in (".bin", ".pkl", ".pt"):
            problem = _zip_problem(path)
        if problem:
            return problem
    return None


def _step_and_time(folder: Path) -> tuple[int, float]:
    try:
        stamp = json.loads((folder / STATE_MARKER).read_text(encoding="utf-8"))
        return int(stamp["step"]), float(stamp["saved_at"])
    except (OSError, ValueError, KeyError, TypeError):
        state = folder / "train_state.json"
        return int(json.loads(state.read_text(encoding="utf-8"))["current_step"]), state.stat().st_mtime


@dataclass
class Found:
    states: list[SavedState] = field(default_factory=list)  # complete ones, oldest first
    skipped: list[str] = field(default_factory=list)  # one line each


def saved_states(runs_dir: Path, output_name: str) -> Found:
    """Every state of this output name under runs_dir/<output_name>/*/: the complete ones, oldest first by when
    they were saved, and a line for each one skipped."""
    found = Found()
    root = runs_dir / output_name
    folders = sorted(root.glob(f"*/{output_name}-*state")) + sorted(root.glob(f"*/{output_name}-state"))
    for folder in folders:
        if not folder.is_dir():
            continue
        problem = state_problem(folder)
        if problem:
            found.skipped.append(f"resume=auto: skipping {folder}: {problem}")
            continue
        step, saved_at = _step_and_time(folder)
        found.states.append(SavedState(folder, step, folder.name == f"{output_name}-state", saved_at))
    for partial in sorted(root.glob(f"*/{output_name}-*{PARTIAL}")):
        found.skipped.append(f"resume=auto: skipping {partial}: a save that did not finish")
    found.states.sort(key=lambda s: (s.saved_at, s.step))
    return found


def newest_state(runs_dir: Path, output_name: str) -> SavedState | None:
    states = saved_states(runs_dir, output_name).states
    return states[-1] if states else None


@dataclass(frozen=True)
class ResumeDecision:
    state: SavedState | None  # where to continue from; None: start fresh, or nothing to do when finished
    finished: bool  # the newest state already reached max_steps
    sentence: str  # what to tell the user
    skipped: tuple[str, ...] = ()  # states passed over, one line each


def resume_decision(runs_dir: Path, output_name: str, max_steps: int | None) -> ResumeDecision:
    found = saved_states(runs_dir, output_name)
    skipped = tuple(found.skipped)
    state = found.states[-1] if found.states else None
    if state is None:
        sentence = f"resume=auto: no complete saved state of '{output_name}' under {runs_dir}; starting fresh"
        return ResumeDecision(None, False, sentence, skipped)
    if max_steps is not None and state.step >= max_steps:
        sentence = (
            f"resume=auto: '{output_name}' already finished ({state.step} of {max_steps} steps, {state.path}); "
            "raise train.max_steps to train further"
        )
        return ResumeDecision(None, True, sentence, skipped)
    sentence = f"resume=auto: continuing '{output_name}' from step {state.step} ({state.path})"
    return ResumeDecision(state, False, sentence, skipped)
