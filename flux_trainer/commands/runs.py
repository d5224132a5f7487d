"""`flux-train runs`: one line per run, read from its TensorBoard events, sweep members with their sweep.

Plain runs are `<root>/<output_name>/<time>/`; sweep members `<root>/sweeps/<sweep time>/<num>_<output_name>/`. A
run's status: `live` while a run holds its output name (flux_trainer.launch.rundir), `done` when its final LoRA
file exists, `stopped` otherwise; a sweep member's is its sweep record's (ok, failed, bad input, interrupted), or
`live` / `no record` without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flux_trainer.config import ConfigError

SWEEPS = "sweeps"


@dataclass
class Listed:
    run_dir: Path
    status: str
    sweep: str | None = None  # the sweep dir's name, for a sweep member


def find_runs(root: Path) -> list[Listed]:
    from flux_trainer.commands.sweep import read_records
    from flux_trainer.launch.rundir import RUN_RECORD, is_locked, live_run_dir

    found: list[Listed] = []
    for out_dir in sorted(p for p in root.iterdir() if p.is_dir() and p.name != SWEEPS):
        runs = sorted(p for p in out_dir.iterdir() if (p / "tb").is_dir() or (p / RUN_RECORD).is_file())
        live = live_run_dir(out_dir) if runs and is_locked(out_dir) else None
        for run_dir in runs:
            if live is not None and live[0] == run_dir:
                status = "live"
            else:
                status = "done" if (run_dir / f"{out_dir.name}.safetensors").is_file() else "stopped"
            found.append(Listed(run_dir, status))
    sweeps = root / SWEEPS
    for sweep_dir in sorted(p for p in sweeps.iterdir() if p.is_dir()) if sweeps.is_dir() else []:
        records = read_records(sweep_dir)
        members = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
        for member in sorted(members, key=_member_number):
            record = records.get(_member_number(member))
            status = record["status"] if record else ("live" if _recent(member) else "no record")
            found.append(Listed(member, status, sweep=sweep_dir.name))
    return found


def _member_number(member: Path) -> int:
    head = member.name.partition("_")[0]
    return int(head) if head.isdigit() else 1 << 30


def _recent(member: Path, seconds: float = 600.0) -> bool:
    """A member without a record is live while its files still change (Hydra's launcher may run it elsewhere)."""
    import time

    newest = max((p.stat().st_mtime for p in member.rglob("*") if p.is_file()), default=member.stat().st_mtime)
    return time.time() - newest < seconds


def runs_command(root: Path) -> int:
    """One line per run dir, read from its TensorBoard events; a sweep's members under the sweep's name."""
    from flux_trainer.metrics.tensorboard import summarize_run

    if not root.is_dir():
        raise ConfigError(f"{root} does not exist; runs are under logging.root (default ./runs)")
    listed = find_runs(root)
    if not listed:
        print(f"no runs under {root}")
        return 0

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = f"{'run':<44} {'status':<11} {'steps':>6} {'last loss':>10} {'val loss':>9} {'s/step':>8}"
    header += f" {'peak VRAM':>10}"  # val loss: the newest validation loss (dataset.validation_split)
    header += f" {'TFLOP/s':>8} {'W':>4} {'SM MHz':>6} {'start-up':>9}"  # the card's medians; to the first step's end
    print(header + "\n" + "-" * len(header))
    sweep = None
    for row in listed:
        if row.sweep != sweep and row.sweep is not None:
            print(f"sweep {root / SWEEPS / row.sweep}:")
        sweep = row.sweep
        try:
            s = summarize_run(row.run_dir)
        except FileNotFoundError:  # no events yet (just started, or refused before training)
            s = None
        name = str(row.run_dir.relative_to(root / SWEEPS / row.sweep if row.sweep else root))
        name = ("  " if row.sweep else "") + (name if len(name) <= 42 else "..." + name[-39:])
        if s is None:
            print(f"{name:<44} {row.status:<11} {'-':>6}")
            continue
        startup = "-" if s.startup_s is None else f"{s.startup_s:.1f} s"
        print(
            f"{name:<44} {row.status:<11} {s.steps_done:>6} {fmt(s.last_loss, '.4f'):>10} "
            f"{fmt(s.last_val_loss, '.4f'):>9} "
            f"{fmt(s.median_step_s, '.3f'):>8} {fmt(s.peak_vram_gib, '.1f'):>8} G {fmt(s.median_tflops, '.0f'):>8} "
            f"{fmt(s.median_power_w, '.0f'):>4} {fmt(s.median_sm_clock_mhz, '.0f'):>6} {startup:>9}"
        )
    print(f"\ncompare: tensorboard --logdir {root}")
    return 0
