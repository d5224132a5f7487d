"""flux_trainer.sdscripts.continuation without sd-scripts: states written whole or not at all, a full disk named, the
run's step in names and files, the resume position of the data, per-step seeds, and a stop honoured between steps.
The real thing, through sd-scripts on the CPU, is in tests/integration/test_resume_cpu.py."""

from __future__ import annotations

import errno
import json
import random
import signal
import types

import pytest
import torch

from flux_trainer.sdscripts import continuation as cont
from flux_trainer.sdscripts import rng_state
from flux_trainer.sdscripts.resume import state_problem
from tests.conftest import undoing


class FakeAccelerator:
    gradient_accumulation_steps = 1

    def __init__(self, fail=None):
        self.dataloader_config = types.SimpleNamespace(use_seedable_sampler=False)
        self.fail, self.loaded = fail, []

    def save_state(self, output_dir):
        from pathlib import Path

        out = Path(output_dir)
        out.mkdir(parents=True)
        (out / "train_state.json").write_text(json.dumps({"current_epoch": 2, "current_step": 3}))
        (out / "optimizer.bin").write_bytes(b"o" * 100)
        if self.fail is not None:
            raise self.fail
        (out / "model.safetensors").write_bytes(b"m" * 10)

    def load_state(self, input_dir):
        self.loaded.append(input_dir)

    def prepare(self, *objects):
        return objects if len(objects) > 1 else objects[0]


def made(tmp_path, resume=None, **kw):
    c = cont.Continuation(str(resume) if resume else None, seed=7, output_name="mine", **kw)
    acc = FakeAccelerator()
    c.accelerator_ready(acc)
    return c, acc


def test_a_state_appears_only_complete_and_stamped_with_the_runs_step(tmp_path):
    c, acc = made(tmp_path)
    c.micro = 5  # five steps of this process
    final = tmp_path / "mine-step00000005-state"
    acc.save_state(str(final))
    assert not list(tmp_path.glob(f"*{cont.PARTIAL}"))
    stamp = json.loads((final / cont.STATE_MARKER).read_text())
    assert stamp["step"] == 5 and set(stamp["files"]) == {"train_state.json", "optimizer.bin", "model.safetensors"}
    assert json.loads((final / "train_state.json").read_text())["current_step"] == 5  # sd-scripts wrote 3
    assert state_problem(final) is None and cont.state_step(final) == (5, 2)
    assert not acc.dataloader_config.use_seedable_sampler  # sd-scripts' own sampler: plain sd-scripts' batch order


def test_a_failed_save_leaves_nothing_and_a_full_disk_says_where_and_what_to_do(tmp_path):
    c, acc = made(tmp_path)
    c.micro = 5
    good = tmp_path / "mine-step00000005-state"
    acc.save_state(str(good))
    acc.fail = OSError(errno.ENOSPC, "No space left on device")
    c.micro = 10
    bad = tmp_path / "mine-step00000010-state"
    with pytest.raises(cont.DiskFull) as info:
        acc.save_state(str(bad))
    text = str(info.value)
    assert str(bad) in text and "GiB free on" in text and "resume=auto" in text and str(good) in text
    assert not bad.exists() and not list(tmp_path.glob(f"*{cont.PARTIAL}"))
    assert state_problem(good) is None  # the state before is untouched
    acc.fail = KeyboardInterrupt()  # a second Ctrl-C mid-save: no half state either, and not called a full disk
    with pytest.raises(KeyboardInterrupt):
        acc.save_state(str(bad))
    assert not bad.exists() and not list(tmp_path.glob(f"*{cont.PARTIAL}"))


def test_torchs_zip_writer_failing_on_a_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    err = RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed")
    monkeypatch.setattr(cont.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=1024, total=1, used=1))
    assert cont.is_disk_full(err, tmp_path)
    monkeypatch.setattr(cont.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=2**40, total=1, used=1))
    assert not cont.is_disk_full(err, tmp_path)


def test_lora_files_are_written_aside_and_carry_the_runs_step(tmp_path):
    state = tmp_path / "mine-step00000040-state"
    state.mkdir()
    (state / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": 40}))
    c, acc = made(tmp_path, resume=state)
    seen = {}

    class Net:
        def save_weights(self, file, dtype, metadata):
            seen["file"], seen["metadata"] = file, metadata
            with open(file, "wb") as f:
                f.write(b"lora")

    net = Net()
    acc.prepare(net, "optimizer")
    net.save_weights(str(tmp_path / "mine.safetensors"), None, {"ss_steps": "5"})
    assert seen["file"].endswith(f"{cont.PARTIAL}.safetensors") and seen["metadata"]["ss_steps"] == "45"
    assert (tmp_path / "mine.safetensors").read_bytes() == b"lora" and not list(tmp_path.glob(f"*{cont.PARTIAL}*"))


def fake_train_util(calls):
    tu = types.SimpleNamespace()
    tu.get_step_ckpt_name = lambda args, ext, step_no: f"mine-step{step_no:08d}{ext}"
    tu.save_and_remove_state_stepwise = lambda args, acc, step_no: calls.append(("state", step_no))

    def get_remove_step_no(args, step_no):
        r = step_no - 2 * args.save_every_n_steps
        return r if r > 0 else None

    tu.get_remove_step_no = get_remove_step_no
    return types.SimpleNamespace(train_util=tu)


def test_names_and_saves_get_the_runs_step_and_are_put_back(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    (state / "train_state.json").write_text(json.dumps({"current_epoch": 3, "current_step": 15}))
    calls = []
    mods = fake_train_util(calls)
    original = mods.train_util.get_step_ckpt_name
    c = cont.Continuation(str(state), 1, "mine")
    c.install(mods)
    args = types.SimpleNamespace(save_every_n_steps=5)
    tu = mods.train_util
    assert tu.get_step_ckpt_name(args, ".safetensors", 5) == "mine-step00000020.safetensors"
    tu.save_and_remove_state_stepwise(args, None, 5)
    assert calls == [("state", 20)]
    removed = tu.get_remove_step_no(args, 5)  # the run's step 20 removes the run's step 10
    assert tu.get_step_ckpt_name(args, "", removed) == "mine-step00000010"
    assert c.run_step(5) == 20
    c.remove()
    assert mods.train_util.get_step_ckpt_name is original
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class Images(torch.utils.data.Dataset):
    """sd-scripts' dataset as randomness sees it: fetching an item draws (its augmentations), and the epoch is set from
    outside (its per-epoch bucket shuffle)."""

    def __init__(self, n):
        self.n, self.epochs = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i, random.random(), float(torch.rand(()))

    def set_current_epoch(self, epoch):
        self.epochs.append(epoch)


def FakeLoader(batches):  # noqa: N802 - stands for a class
    """The training loader as the runner meets it: accelerate's DataLoaderShard (it fetches one batch ahead) around
    the torch DataLoader sd-scripts makes (shuffled, batch size 1)."""
    from accelerate.data_loader import DataLoaderShard

    return DataLoaderShard(Images(batches), batch_size=1, shuffle=True, collate_fn=lambda items: items[0])


def train(tmp_path, steps, c=None, acc=None, loader=None, start=0, saves=(), stop_before=None):
    """sd-scripts' loop as far as randomness goes: `set_seed`, the LoRA's init, then epochs of shuffled batches, each
    step drawing its noise; with `c` our runner's Continuation in it (states saved after the steps in `saves`, a stop
    requested before step `stop_before`). Returns [(step, batch, noise)]."""
    if c is None:
        torch.manual_seed(5), random.seed(5)  # sd-scripts' set_seed
        torch.rand(3)  # the LoRA's init
        loader = FakeLoader(6)
    out, step = [], start
    args = types.SimpleNamespace(max_train_steps=steps)
    while step < steps:
        for batch in loader:
            if c is not None:
                if stop_before == step + 1:
                    c.stop_signal = "SIGINT"
                c.step_start(args)
            out.append((step + 1, *batch, torch.rand(2).tolist()))
            step += 1
            if c is not None and step in saves:
                acc.save_state(str(tmp_path / f"s{step}"))
            if step >= steps:
                break
    return out


def ours(tmp_path, resume=None):
    c, acc = made(tmp_path, resume=resume)
    c.train_util = types.SimpleNamespace(
        save_and_remove_state_stepwise=lambda args, a, n: a.save_state(str(tmp_path / f"s{c.done()}"))
    )
    torch.manual_seed(5), random.seed(5)
    torch.rand(3)
    loader = FakeLoader(6)
    acc.prepare(object(), loader, FakeLoader(2))  # the training loader comes before the validation one
    if resume:
        torch.manual_seed(999), random.seed(999)  # whatever the process drew since
        acc.load_state(str(resume))
    return c, acc, loader


def test_the_run_draws_what_plain_sd_scripts_draws(tmp_path):
    """Same seed, same TOMLs: the same batches in the same order and the same noise at every step as sd-scripts
    alone (no re-seeding, no sampler of our own), across epochs."""
    plain = train(tmp_path, 15)
    c, acc, loader = ours(tmp_path)
    assert train(tmp_path, 15, c, acc, loader) == plain
    assert not loader.skip_batches


@pytest.mark.parametrize("at", [3, 6, 9])  # inside the first epoch, at its end, inside the second
def test_a_resumed_run_trains_the_steps_the_run_would_have(tmp_path, at):
    whole = train(tmp_path, 15)
    c, acc, loader = ours(tmp_path)
    assert train(tmp_path, at, c, acc, loader, saves={at}) == whole[:at]
    state = tmp_path / f"s{at}"
    assert (state / rng_state.STATE_FILE).is_file() and state_problem(state) is None
    c, acc, loader = ours(tmp_path, resume=state)
    # sd-scripts' bucket shuffles replayed to that epoch: inside one, its own shuffle too (the stopped run had it)
    assert loader.dataset.epochs == [at // 6 + (1 if at % 6 else 0)]
    assert train(tmp_path, 15, c, acc, loader, start=at) == whole[at:]


@pytest.mark.parametrize("stop", [4, 7])  # the stopped step's batch inside an epoch, the first of one
def test_a_run_stopped_at_a_steps_start_resumes_with_that_steps_batch_and_noise(tmp_path, stop):
    whole = train(tmp_path, 15)
    c, acc, loader = ours(tmp_path)
    with pytest.raises(cont.Interrupted):
        train(tmp_path, 15, c, acc, loader, stop_before=stop)
    state = tmp_path / f"s{stop - 1}"
    c, acc, loader = ours(tmp_path, resume=state)
    assert train(tmp_path, 15, c, acc, loader, start=stop - 1) == whole[stop - 1 :]


def test_a_state_without_the_record_still_resumes_at_its_position(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    (state / "train_state.json").write_text(json.dumps({"current_epoch": 3, "current_step": 15}))
    c, acc, loader = ours(tmp_path, resume=state)
    assert loader.skip_batches == 3 and loader.dataset.epochs == [3]  # inside the third epoch: its shuffle too
    args = types.SimpleNamespace(max_train_steps=40)
    c.step_start(args)
    assert args.max_train_steps == 40 - 15  # sd-scripts counts from 0


def test_a_stop_request_ends_the_run_after_a_whole_step_with_a_state(tmp_path):
    calls = []
    mods = fake_train_util(calls)
    c = cont.Continuation(None, 1, "mine")
    c.install(mods)
    with undoing(c.remove):
        c.accelerator = FakeAccelerator()
        with pytest.raises(KeyboardInterrupt):  # before the first step: nothing to save, stop now
            c._on_signal(signal.SIGINT, None)
        args = types.SimpleNamespace(max_train_steps=40)
        for _ in range(7):
            c.step_start(args)
        c._on_signal(signal.SIGTERM, None)
        with pytest.raises(cont.Interrupted) as info:
            c.step_start(args)
        assert info.value.step == 7 and calls == [("state", 7)] and "resume=auto continues" in str(info.value)
        with pytest.raises(KeyboardInterrupt):  # asked twice: stop at once
            c._on_signal(signal.SIGINT, None)


def test_with_gradient_accumulation_the_stop_waits_for_the_optimizer_step(tmp_path):
    c = cont.Continuation(None, 1, "mine")
    c.accumulation = 4
    args = types.SimpleNamespace(max_train_steps=40)
    for _ in range(6):  # one whole step and half of the next
        c.step_start(args)
    c.stop_signal = "SIGINT"
    c.step_start(args)
    c.step_start(args)  # the second step's last two micro-batches still run
    with pytest.raises(cont.Interrupted) as info:
        c.step_start(args)
    assert info.value.step == 2


def test_several_processes_keep_the_default_signal_handling(tmp_path):
    c = cont.Continuation(None, 1, "mine", processes=2)
    c.install(fake_train_util([]))
    with undoing(c.remove):
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_building_the_caches_draws_nothing_the_run_keeps(tmp_path):
    """sd-scripts builds its caches between loading the model and making the LoRA: building them draws (the VAE
    samples), reusing them (plain sd-scripts after our run) draws nothing. The hooks put every generator back, and
    do not re-seed: what sd-scripts drew before (its bucket shuffle) stays drawn."""
    import random

    import numpy as np

    from flux_trainer.sdscripts.hooks import RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    torch.manual_seed(42), random.seed(42), np.random.seed(42)
    random.random(), torch.rand(1)  # sd-scripts' draws before the model loads
    h.model_loaded(None, types.SimpleNamespace(device=torch.device("cpu")))
    reused = (torch.rand(4).tolist(), random.random(), np.random.rand())
    torch.randn(16), random.random(), np.random.rand()  # the caches being built
    h.caches_ready(types.SimpleNamespace(seed=42))
    assert (torch.rand(4).tolist(), random.random(), np.random.rand()) == reused


class Shuffling:
    """sd-scripts' dataset at an epoch change: `set_current_epoch` shuffles once per epoch passed, re-seeding Python's
    generator (`random.seed(seed + epoch)`, train_util.BaseDataset.shuffle_buckets)."""

    def __init__(self):
        self.current, self.shuffles = 0, 0

    def set_current_epoch(self, epoch):
        while self.current < epoch:
            self.current += 1
            random.seed(42 + self.current)
            self.shuffles += 1


@pytest.mark.parametrize(("epoch", "skip", "want"), [(1, 5, 2), (1, 0, 1), (0, 3, 1), (2, 0, 2)])
def test_a_resume_inside_an_epoch_replays_that_epochs_shuffle_too_with_the_generators_untouched(epoch, skip, want):
    """Stopped inside an epoch, the run had that epoch's shuffle (at its first fetch) before its save: the resumed
    run replays it as well, so its first fetch does not shuffle (and re-seed Python's generator) again; at an epoch's
    end the next epoch's first fetch shuffles, as in the run never stopped. Either way nothing the run draws moves."""
    c = cont.Continuation(None, 42, "tiny")
    c.loader = types.SimpleNamespace(dataset=Shuffling())
    random.seed(7)
    torch.manual_seed(7)
    before = (random.getstate(), torch.get_rng_state())
    c.data_epoch(epoch, skip)
    assert c.loader.dataset.current == want and c.loader.dataset.shuffles == want
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])


def test_how_a_stopped_training_process_ends_is_one_code_and_line_for_both_runners(caplog):
    """A stop request after a whole step, an interrupt before one could finish, a full disk: each runner's main()
    exits with this code and writes this line into its exit record (flux_trainer.backend.exit_record)."""
    import logging

    log = logging.getLogger("test")
    with caplog.at_level("WARNING", logger="test"):
        assert cont.stopped(cont.Interrupted(7, "SIGINT", "/s"), log) == (130, str(cont.Interrupted(7, "SIGINT", "/s")))
        code, reason = cont.stopped(KeyboardInterrupt("SIGTERM"), log)
        assert code == 130 and reason.startswith("interrupted (SIGTERM) before a step could finish; resume=auto")
        assert cont.stopped(cont.DiskFull("disk full while saving /x"), log) == (4, "disk full while saving /x")
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "ERROR"]
