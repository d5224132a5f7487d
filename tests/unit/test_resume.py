"""resume=auto: the newest complete saved state of the same output name; incomplete or damaged ones are skipped with
a line naming them; finished runs say so."""

from __future__ import annotations

import json
import os
import time
import zipfile

from flux_trainer.sdscripts.continuation import PARTIAL, STATE_MARKER
from flux_trainer.sdscripts.resume import newest_state, resume_decision, saved_states, state_problem


def state(runs, run, name, step, saved_at=None, stamped=True):
    """A complete state as flux-train saves it: accelerate's files, sd-scripts' train_state.json, our stamp."""
    d = runs / "mychar" / run / name
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": step}))
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        with zipfile.ZipFile(d / name, "w") as z:
            z.writestr("archive/data.pkl", b"x" * 64)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    if stamped:
        files = {p.name: p.stat().st_size for p in d.iterdir()}
        stamp = {"step": step, "epoch": 1, "saved_at": saved_at or time.time(), "files": files}
        (d / STATE_MARKER).write_text(json.dumps(stamp))
    return d


def test_the_newest_complete_state_across_runs(tmp_path):
    state(tmp_path, "2026-01-01_10-00-00", "mychar-step00000250-state", 250, saved_at=100)
    newest = state(tmp_path, "2026-01-02_10-00-00", "mychar-step00000500-state", 500, saved_at=300)
    state(tmp_path, "2026-01-02_10-00-00", "mychar-step00000100-state", 100, saved_at=200)
    state(tmp_path, "x", "other-step00009999-state", 9999).rename(tmp_path / "mychar" / "x" / "other-state")
    got = newest_state(tmp_path, "mychar")
    assert got.path == newest and got.step == 500 and not got.final


def test_a_fresh_run_after_a_longer_one_is_the_newest(tmp_path):
    """Newest is when it was saved, not the largest step: a run started over (resume=off) after a longer run."""
    state(tmp_path, "a", "mychar-step00000900-state", 900, saved_at=100)
    restarted = state(tmp_path, "b", "mychar-step00000200-state", 200, saved_at=500)
    assert newest_state(tmp_path, "mychar").path == restarted


def test_incomplete_and_damaged_states_are_skipped_with_a_line_each(tmp_path):
    good = state(tmp_path, "a", "mychar-step00000005-state", 5, saved_at=100)
    killed = state(tmp_path, "a", "mychar-step00000010-state", 10, saved_at=200, stamped=False)
    for p in killed.iterdir():  # killed mid-save by sd-scripts alone: only train_state.json was written
        if p.name != "train_state.json":
            p.unlink()
    full = state(tmp_path, "a", "mychar-step00000015-state", 15, saved_at=300)
    with open(full / "optimizer.bin", "r+b") as f:  # the disk filled up: shorter than the stamp says
        f.truncate(10)
    old = state(tmp_path, "a", "mychar-step00000020-state", 20, saved_at=400, stamped=False)
    with open(old / "model.safetensors", "r+b") as f:  # an unstamped state whose weights were cut short
        f.truncate((old / "model.safetensors").stat().st_size - 4)
    partial = tmp_path / "mychar" / "a" / f"mychar-step00000025-state{PARTIAL}"
    partial.mkdir()
    found = saved_states(tmp_path, "mychar")
    assert [s.path for s in found.states] == [good]
    text = "\n".join(found.skipped)
    assert len(found.skipped) == 4, text
    assert f"{killed}: train_state.json" not in text and "no network weights" in text
    assert f"{full}: optimizer.bin has 10 bytes" in text
    assert f"{old}: model.safetensors is truncated" in text
    assert f"{partial}: a save that did not finish" in text
    decision = resume_decision(tmp_path, "mychar", 100)
    assert decision.state.path == good and decision.skipped == tuple(found.skipped)


def test_an_unstamped_state_with_a_damaged_zip_member_is_found(tmp_path):
    d = state(tmp_path, "a", "mychar-step00000005-state", 5, stamped=False)
    assert state_problem(d) is None
    data = bytearray((d / "optimizer.bin").read_bytes())
    i = data.index(b"x" * 64)
    data[i : i + 4] = b"yyyy"  # same size, wrong CRC
    (d / "optimizer.bin").write_bytes(bytes(data))
    assert "optimizer.bin is damaged" in state_problem(d)


def test_decisions(tmp_path):
    d = resume_decision(tmp_path, "mychar", 1000)
    assert d.state is None and not d.finished and "starting fresh" in d.sentence
    state(tmp_path, "a", "mychar-step00000500-state", 500, saved_at=1)
    d = resume_decision(tmp_path, "mychar", 1000)
    assert d.state.step == 500 and not d.finished and "from step 500" in d.sentence
    state(tmp_path, "b", "mychar-state", 1000, saved_at=2)
    d = resume_decision(tmp_path, "mychar", 1000)
    assert d.state is None and d.finished and "already finished" in d.sentence and "train.max_steps" in d.sentence
    d = resume_decision(tmp_path, "mychar", 2000)
    assert d.state.step == 1000 and d.state.final


def test_an_unstamped_state_is_dated_by_its_train_state(tmp_path):
    a = state(tmp_path, "a", "mychar-step00000005-state", 5, stamped=False)
    b = state(tmp_path, "b", "mychar-step00000003-state", 3, stamped=False)
    os.utime(a / "train_state.json", (1000, 1000))
    os.utime(b / "train_state.json", (2000, 2000))
    assert newest_state(tmp_path, "mychar").path == b
