"""resume on musubi-tuner's models without musubi-tuner: the key is no longer refused, the TOML names the state, the
state is chosen as on sd-scripts' side (musubi-tuner's states have no train_state.json: our stamp is their record),
and the training process's wrappers put the run's step and epoch in names, logs, metadata and max_train_steps.
The real thing, through musubi-tuner on the CPU, is tests/integration/test_musubi_resume_cpu.py."""

from __future__ import annotations

import json
import time
import types
import zipfile

import pytest
from omegaconf import OmegaConf

from flux_trainer import app
from flux_trainer.backend.options import refusals
from flux_trainer.musubi.continuation import EpochCounter, MusubiContinuation
from flux_trainer.musubi.translate import training_document
from flux_trainer.plan import absolute_paths
from flux_trainer.sdscripts.continuation import STATE_MARKER
from tests.conftest import undoing
from tests.unit.test_musubi_translate import RUN


def musubi_state(runs, run, name, step):
    """A state as flux-train saves it from musubi-tuner: accelerate's files and our stamp, no train_state.json."""
    d = runs / "tiny" / run / name
    d.mkdir(parents=True)
    for file in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        with zipfile.ZipFile(d / file, "w") as z:
            z.writestr("archive/data.pkl", b"x" * 64)
    files = {p.name: p.stat().st_size for p in d.iterdir()}
    (d / STATE_MARKER).write_text(json.dumps({"step": step, "epoch": 0, "saved_at": time.time(), "files": files}))
    return d


@pytest.mark.parametrize("resume", ["auto", "/some/state"])
def test_resume_is_no_longer_refused_on_musubi_models(resume):
    cfg = OmegaConf.create({"resume": resume, "model": {}, "train": {}, "kernels": {"set": "auto"}})
    assert not [p for p in refusals(cfg, "musubi", "random_flux2_klein_tiny") if "resume" in p]


def test_the_training_toml_names_the_state_and_saves_states_by_default(compose, tmp_path):
    cfg = compose("+dataset=mychar", "model=random_flux2_klein_tiny")
    absolute_paths(cfg)
    assert cfg.train.save_state is True  # musubi-tuner saves states only when told
    fresh = training_document(cfg, RUN)[0].flat()
    assert fresh["save_state"] is True and "resume" not in fresh
    state = tmp_path / "tiny-step00000004-state"
    resumed = training_document(cfg, RUN, state)[0]
    assert resumed.flat()["resume"] == str(state) and f'resume = "{state}"' in resumed.dumps()


def test_the_state_is_chosen_as_on_sd_scripts_side(tmp_path, capsys):
    cfg = OmegaConf.create({"resume": "auto", "train": {"output_name": "tiny", "max_steps": 8}})
    assert app.resume_state(cfg, tmp_path) is None
    assert "starting fresh" in capsys.readouterr().out
    musubi_state(tmp_path, "a", "tiny-step00000002-state", 2)
    newest = musubi_state(tmp_path, "b", "tiny-step00000004-state", 4)
    chosen = app.resume_state(cfg, tmp_path)
    assert chosen.path == newest and chosen.step == 4
    assert "continuing 'tiny' from step 4" in capsys.readouterr().out
    musubi_state(tmp_path, "c", "tiny-state", 8)
    with pytest.raises(app.FinishedRun, match="already finished"):
        app.resume_state(cfg, tmp_path)
    by_hand = OmegaConf.merge(cfg, {"resume": str(newest)})
    assert app.resume_state(by_hand, tmp_path).path == newest
    assert app.resume_state(OmegaConf.merge(cfg, {"resume": "off"}), tmp_path) is None


def fake_train_utils():
    """musubi-tuner's train_utils' signatures, recording what they were given."""
    seen = []
    tu = types.SimpleNamespace(seen=seen)
    tu.get_step_ckpt_name = lambda name, n: f"{name}-step{n:08d}.safetensors"
    tu.get_epoch_ckpt_name = lambda name, n: f"{name}-{n:06d}.safetensors"
    tu.save_and_remove_state_stepwise = lambda args, acc, n: seen.append(("step", n))
    tu.save_and_remove_state_on_epoch_end = lambda args, acc, n: seen.append(("epoch", n))
    tu.get_remove_step_no = lambda args, n: n - 4 if n > 4 else None
    tu.get_remove_epoch_no = lambda args, n: n - 2 if n > 2 else None
    return tu


class Loader:
    def __init__(self, n):
        self.n, self.skip_batches, self.base_dataloader = n, 0, None

    def __len__(self):
        return self.n


def test_the_wrappers_speak_the_runs_steps_and_epochs(tmp_path):
    state = musubi_state(tmp_path, "a", "tiny-step00000006-state", 6)
    c = MusubiContinuation(str(state), seed=1, output_name="tiny")
    tu = fake_train_utils()
    with undoing(c.remove):
        c.install(tu)
        c.loader = Loader(4)
        c.epoch_offset = 1  # 4 batches an epoch: step 6 is in the second epoch
        assert tu.get_step_ckpt_name("tiny", 2) == "tiny-step00000008.safetensors"
        assert tu.get_epoch_ckpt_name("tiny", 1) == "tiny-000002.safetensors"
        tu.save_and_remove_state_stepwise(None, None, 2)
        tu.save_and_remove_state_on_epoch_end(None, None, 1)
        assert tu.seen == [("step", 8), ("epoch", 2)]
        assert tu.get_remove_step_no(None, 4) == 0  # run step 10 removes run step 6: the name adds 6 back
        args = types.SimpleNamespace(max_train_steps=10)
        c.train_start(args)  # its loop counts its epochs from here: the resumed epoch's start to N
        assert c.max_steps == 10 and args.max_train_steps == 10 - 4
        c.step_start(args)  # the first step: the steps left
        assert args.max_train_steps == 4 and c.max_steps == 10
        meta = c.run_metadata({"ss_steps": "4", "ss_epoch": "2", "ss_max_train_steps": "6"})
        assert meta == {"ss_steps": "10", "ss_epoch": "3", "ss_max_train_steps": "10"}
    assert tu.get_step_ckpt_name("tiny", 2) == "tiny-step00000002.safetensors"  # undone


def test_the_loops_epoch_and_step_logs_are_the_runs(tmp_path):
    state = musubi_state(tmp_path, "a", "tiny-step00000006-state", 6)
    c = MusubiContinuation(str(state), seed=1, output_name="tiny")
    logged = []
    acc = types.SimpleNamespace(gradient_accumulation_steps=1, log=lambda values, step=None: logged.append(step))
    acc.save_state = acc.load_state = acc.prepare = lambda *a, **k: None
    c.accelerator_ready(acc)
    c.epoch_offset = 1
    c.step_log = True  # extra_step_logs came first: a step's log
    acc.log({"loss/current": 1.0}, step=1)
    acc.log({"loss/epoch": 1.0}, step=1)  # the loop's epoch 1 is the run's second
    acc.log({}, step=0)
    assert logged == [7, 2, 0]
    shared = types.SimpleNamespace(value=0)
    counter = EpochCounter(shared, c)
    counter.value = 1  # the loop's first epoch
    assert shared.value == 2 and counter.value == 1
    c.remove()
    acc.log({}, step=3)
    assert logged[-1] == 3
