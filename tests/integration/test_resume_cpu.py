"""Resume through sd-scripts on the CPU, as a user meets it: a run stopped twice with Ctrl-C and continued twice with
`resume=auto` trains the same steps, with the same losses, as a run that was never stopped.

Why equal, not close: the run draws sd-scripts' own random stream, and a state records what replaying it needs (the
epoch's batch order, the generators before each batch fetched ahead and at the save: rng_state); the data position,
optimizer, LR schedule and network weights come back from the state, and the CPU kernels give the same result for the
same inputs and thread count. So the tolerance is float32 rounding (1e-6 relative); any
larger difference is a step, a batch or a random draw out of place.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.tiny_run import CHECKOUT, WHY, interrupted_run, run_scalars, state_step

pytestmark = pytest.mark.sd_scripts

STEPS = 16


class Work:
    def __init__(self, root: Path, images: Path, cache: Path):
        self.root = root
        (root / "configs" / "dataset").mkdir(parents=True)
        (root / "configs" / "dataset" / "tiny.yaml").write_text(
            f"name: tiny\nimages: {images}\nresolution: 128\nrepeats: 1\nmin_bucket_reso: 64\nmax_bucket_reso: 256\n"
        )
        self.env = {k: v for k, v in os.environ.items() if k != "FLUX_TRAIN_TOKENIZER_DIR"}
        self.env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", FLUX_TRAIN_CACHE=str(cache))
        self.env.update(FLUX_TRAIN_SD_SCRIPTS=str(CHECKOUT.path))

    def command(self, *extra: str) -> list[str]:
        exe = shutil.which("flux-train")
        head = [exe] if exe else [sys.executable, "-m", "flux_trainer.cli"]
        return [*head, "+dataset=tiny", "model=random_tiny", f"train.max_steps={STEPS}",
                "train.save_every_n_steps=5", "train.data_loader_workers=0", "memory=cpu", *extra]  # fmt: skip

    def run(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*extra), cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=900)  # fmt: skip

    def interrupted(self, after: int, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
        """Run, and press Ctrl-C (SIGINT to flux-train) once a state of a step after `after` exists."""
        return interrupted_run(self.command(*extra), self.root, self.env, after), self.newest_run()

    def newest_run(self) -> Path:
        return sorted(p for p in (self.root / "runs" / "tiny").iterdir() if p.is_dir())[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    from PIL import Image

    base = tmp_path_factory.mktemp("resume")
    images = base / "pics"
    images.mkdir()
    for i in range(6):  # 6 batches an epoch: the stops land inside epochs and the run crosses several
        Image.new("RGB", (128, 96 if i % 2 else 128), (40 * i, 90, 160)).save(images / f"im{i}.png")
        (images / f"im{i}.txt").write_text(f"a flat colour picture number {i}")
    cache = base / "cache"
    whole = Work(base / "whole", images, cache)
    done = whole.run()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return whole, Work(base / "stopped", images, cache), images


def test_stopped_twice_and_resumed_twice_trains_what_one_run_trains(runs):
    whole, stopped, images = runs
    before = sorted(p.name for p in images.iterdir())
    want = run_scalars(whole.newest_run(), "loss/current")
    assert sorted(want) == list(range(1, STEPS + 1))

    first, run1 = stopped.interrupted(after=0)
    assert first.returncode == 130, first.stdout[-3000:] + first.stderr[-3000:]
    k1 = max(run_scalars(run1, "loss/current"))
    said = first.stdout + first.stderr
    assert f"interrupted at step {k1} (SIGINT)" in said and "Traceback" not in said
    assert (run1 / f"tiny-step{k1:08d}-state").is_dir()  # the step in progress finished and was saved

    second, run2 = stopped.interrupted(k1, "resume=auto")
    assert second.returncode == 130, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"continuing 'tiny' from step {k1}" in second.stdout
    got2 = run_scalars(run2, "loss/current")
    k2 = max(got2)
    assert sorted(got2) == list(range(k1 + 1, k2 + 1)) and k2 < STEPS

    third = stopped.run("resume=auto")
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert f"continuing 'tiny' from step {k2}" in third.stdout
    run3 = stopped.newest_run()
    got3 = run_scalars(run3, "loss/current")
    assert sorted(got3) == list(range(k2 + 1, STEPS + 1))  # stops at N, TensorBoard steps continue

    got = {**run_scalars(run1, "loss/current"), **got2, **got3}
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-6 * abs(loss), (step, got[step], loss)
    lr_want, lr_got = run_scalars(whole.newest_run(), "lr/d*lr/unet"), run_scalars(run3, "lr/d*lr/unet")
    assert all(abs(lr_got[s] - lr_want[s]) <= 1e-6 * abs(lr_want[s]) for s in lr_got)  # Prodigy's d continues

    # states are named by the run's step and say it; the final LoRA is the uninterrupted run's
    assert (run3 / "tiny-state").is_dir() and not list(run3.glob("tiny-step0000000[0-5]-state"))
    for state in run3.glob("tiny-step*-state"):
        assert state_step(state) > k2
    from safetensors.torch import load_file

    a, b = load_file(whole.newest_run() / "tiny.safetensors"), load_file(run3 / "tiny.safetensors")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-6 * a[k].abs().max() + 1e-9 for k in a)

    # the user's folder was read, never written (sd-scripts' caches are in flux-train's cache)
    assert sorted(p.name for p in images.iterdir()) == before

    again = stopped.run("resume=auto")
    assert again.returncode == 0 and "already finished" in again.stdout
