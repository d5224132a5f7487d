"""Resume through musubi-tuner on the CPU (FLUX.2 klein, the tiny random preset), as a user meets it: a run stopped
with Ctrl-C and continued with `resume=auto` trains the steps, with the losses, of a run that was never stopped.

musubi-tuner restarts its step and epoch counts at 0 after loading a state, writes no record of the step, and has no
stop request of its own; flux_trainer.musubi.continuation makes the run continue (the step offset, the epochs, the
batch order replayed, states stamped with the run's step). Equal losses, not close: the same reasoning as
test_resume_cpu.py (the same random stream, replayed; float32 rounding is the tolerance).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.integration.tiny_run import (
    CHECKOUT,
    cli,
    fresh_env,
    interrupted_run,
    run_scalars,
    state_step,
    tiny_dataset,
)
from tests.musubi_checkout import MUSUBI, need_musubi

pytestmark = [pytest.mark.musubi, pytest.mark.sd_scripts]

STEPS = 10  # 4 batches an epoch: the stop lands in the second epoch (after step 4), the run ends in the third


def runs_of(work: Path) -> list[Path]:
    return sorted(p for p in (work / "runs" / "tiny").iterdir() if p.is_dir())


class Work:
    def __init__(self, root: Path, dataset: Path, cache: Path):
        self.root = root
        shutil.copytree(dataset / "configs", root / "configs")  # the same images: musubi-tuner's caches are reused
        self.env = fresh_env(root)
        self.env.update(FLUX_TRAIN_CACHE=str(cache), FLUX_TRAIN_MUSUBI_TUNER=str(MUSUBI.path))

    def command(self, *extra: str) -> list[str]:
        return cli("+dataset=tiny", "model=random_flux2_klein_tiny", f"train.max_steps={STEPS}",
                   "train.save_every_n_steps=2", "train.data_loader_workers=0", *extra)  # fmt: skip

    def run(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*extra), cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=900)  # fmt: skip

    def interrupted(self, after: int, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
        """Run, and press Ctrl-C (SIGINT to flux-train) once a state of a step after `after` exists."""
        return interrupted_run(self.command(*extra), self.root, self.env, after), runs_of(self.root)[-1]


@pytest.fixture(scope="module")
def works(tmp_path_factory):
    need_musubi()
    if CHECKOUT is None:
        pytest.skip("needs an sd-scripts checkout (the random sets are written with its code)")
    base = tmp_path_factory.mktemp("musubi-resume")
    tiny_dataset(base)
    cache = base / "cache"  # shared: the second work reuses the random model and musubi-tuner's caches
    whole = Work(base / "whole", base, cache)
    done = whole.run()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return whole, Work(base / "stopped", base, cache)


def test_a_stopped_klein_run_resumed_with_auto_trains_what_one_run_trains(works):
    whole, stopped = works
    want = run_scalars(runs_of(whole.root)[-1], "loss/current")
    assert sorted(want) == list(range(1, STEPS + 1))

    first, run1 = stopped.interrupted(after=4)
    said = first.stdout + first.stderr
    assert first.returncode == 130, said[-3000:]
    k = max(run_scalars(run1, "loss/current"))
    assert f"interrupted at step {k} (SIGINT)" in said and "Traceback" not in said
    assert 4 < k < STEPS and (run1 / f"tiny-step{k:08d}-state").is_dir()  # the step in progress finished, was saved

    second = stopped.run("resume=auto")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"continuing 'tiny' from step {k}" in second.stdout
    run2 = runs_of(stopped.root)[-1]
    assert run2 != run1
    assert f'resume = "{run1 / f"tiny-step{k:08d}-state"}"' in (run2 / "musubi_tuner.toml").read_text()
    got2 = run_scalars(run2, "loss/current")
    assert sorted(got2) == list(range(k + 1, STEPS + 1))  # TensorBoard's steps continue; the run stops at N

    # states and LoRA files are named by the run's step; the final LoRA says N steps
    assert (run2 / "tiny-state").is_dir() and all(state_step(s) > k for s in run2.glob("tiny-step*-state"))
    for lora in run2.glob("tiny-step*.safetensors"):
        assert int(re.search(r"step(\d+)", lora.name).group(1)) > k
    with safe_open(str(run2 / "tiny.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_steps"] == str(STEPS) and meta["ss_max_train_steps"] == str(STEPS) and meta["ss_epoch"] == "3"

    # the same steps as the run never stopped: the batch order and the random draws replayed
    got = {**run_scalars(run1, "loss/current"), **got2}
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-6 * abs(loss), (step, got[step], loss)

    again = stopped.run("resume=auto")
    assert again.returncode == 0 and "already finished" in again.stdout
