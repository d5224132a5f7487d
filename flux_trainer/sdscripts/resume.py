"""Find the newest saved training state of a run, for `resume=auto`.

sd-scripts saves accelerate states as `<output_name>-step00000250-state`, `<output_name>-000003-state` (epochs)
and `<output_name>-state` (end of training), each with a `train_state.json` holding `current_step`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SavedState:
    path: Path
    step: int
    final: bool  # saved at the end of training


def saved_states(runs_dir: Path, output_name: str) -> list[SavedState]:
    """Every complete state of this output name under runs_dir/<output_name>/*/, oldest first by step."""
    states = []
    for state_file in sorted((runs_dir / output_name).glob(f"*/{output_name}-*state/train_state.json")):
        try:
            step = int(json.loads(state_file.read_text())["current_step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a state interrupted mid-write is not a state
        folder = state_file.parent
        states.append(SavedState(folder, step, final=folder.name == f"{output_name}-state"))
    return sorted(states, key=lambda s: (s.step, s.path.stat().st_mtime))


def newest_state(runs_dir: Path, output_name: str) -> SavedState | None:
    states = saved_states(runs_dir, output_name)
    return states[-1] if states else None


@dataclass(frozen=True)
class ResumeDecision:
    state: SavedState | None  # where to continue from; None: start fresh, or nothing to do when finished
    finished: bool  # the newest state already reached max_steps
    sentence: str  # what to tell the user


def resume_decision(runs_dir: Path, output_name: str, max_steps: int | None) -> ResumeDecision:
    state = newest_state(runs_dir, output_name)
    if state is None:
        return ResumeDecision(
            None, False, f"resume=auto: no saved state of '{output_name}' under {runs_dir}; starting fresh"
        )
    if max_steps is not None and state.step >= max_steps:
        return ResumeDecision(
            None,
            True,
            (
                f"resume=auto: '{output_name}' already finished ({state.step} of {max_steps} steps, {state.path}); "
                f"raise train.max_steps to train further"
            ),
        )
    return ResumeDecision(
        state, False, f"resume=auto: continuing '{output_name}' from step {state.step} ({state.path})"
    )
