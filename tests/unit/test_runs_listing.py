"""`flux-train runs`: plain runs with their status (live, done, stopped), sweep members under their sweep with the
sweep record's status, runs without events yet; read from real TensorBoard event files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from flux_trainer.cli import main
from flux_trainer.commands import sweep
from flux_trainer.commands.runs import find_runs
from flux_trainer.launch import rundir
from tests.conftest import undoing


def events(run_dir: Path, steps: int, loss0: float = 1.0) -> Path:
    with SummaryWriter(str(run_dir / "tb" / "network_train")) as w:
        for s in range(1, steps + 1):
            w.add_scalar("loss/current", loss0 / s, s)
            w.add_scalar("time/step_s", 0.5, s)
    return run_dir


def run_dir(root: Path, name: str, stamp: str, *, steps: int, lora: bool) -> Path:
    d = events(root / name / stamp, steps)
    if lora:
        (d / f"{name}.safetensors").write_bytes(b"x")
    return d


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    run_dir(root, "alice", "2026-11-28_08-00-00", steps=12, lora=True)
    run_dir(root, "alice", "2026-11-28_09-00-00", steps=5, lora=False)  # Ctrl-C: a state, no final LoRA
    sweep_dir = root / "sweeps" / "2026-11-28_10-00-00"
    for num, code in ((0, 0), (1, 1)):
        member = events(sweep_dir / f"{num}_bob", 3 + num)
        sweep.record_member(sweep_dir, num, overrides=[f"network.rank={8 << num}"], run_dir=member, code=code)
    old = sweep_dir / "2_bob"
    old.mkdir()
    (old / "train.log").write_text("started\n")
    os.utime(old / "train.log", (time.time() - 3600, time.time() - 3600))  # no record, nothing written for an hour
    return root


def test_plain_runs_and_sweep_members_with_their_status(root):
    got = [(str(r.run_dir.relative_to(root)), r.status, r.sweep) for r in find_runs(root)]
    assert got == [
        ("alice/2026-11-28_08-00-00", "done", None),
        ("alice/2026-11-28_09-00-00", "stopped", None),
        ("sweeps/2026-11-28_10-00-00/0_bob", "ok", "2026-11-28_10-00-00"),
        ("sweeps/2026-11-28_10-00-00/1_bob", "failed", "2026-11-28_10-00-00"),
        ("sweeps/2026-11-28_10-00-00/2_bob", "no record", "2026-11-28_10-00-00"),
    ]


def test_a_live_run_is_named_live_and_a_member_still_writing_too(root):
    lock = rundir.lock_output(root / "carol")
    live = rundir.claim_run_dir(root / "carol" / "2026-11-28_11-00-00")
    with undoing(lock.release):
        (root / "sweeps" / "2026-11-28_10-00-00" / "3_bob").mkdir()
        status = {str(r.run_dir.relative_to(root)): r.status for r in find_runs(root)}
        assert status["carol/2026-11-28_11-00-00"] == "live" and live.name == "2026-11-28_11-00-00"
        assert status["sweeps/2026-11-28_10-00-00/3_bob"] == "live"
    status = {str(r.run_dir.relative_to(root)): r.status for r in find_runs(root)}
    assert status["carol/2026-11-28_11-00-00"] == "stopped"  # the lock released: no longer live


def test_the_listing_prints_members_under_their_sweep(root, capsys):
    assert main(["runs", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, ln in enumerate(out) if ln.startswith("sweep "))
    assert out[head].endswith("2026-11-28_10-00-00:")
    members = [ln.split() for ln in out[head + 1 : head + 4]]
    assert [m[:3] for m in members] == [["0_bob", "ok", "3"], ["1_bob", "failed", "4"], ["2_bob", "no", "record"]]
    plain = next(ln.split() for ln in out if ln.startswith("alice/2026-11-28_08"))
    assert plain[1:3] == ["done", "12"] and float(plain[3]) == pytest.approx(1 / 12, rel=1e-3)


def test_a_missing_root_is_one_line(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
