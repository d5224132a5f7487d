"""kernels.cuda_graphs=true in a whole training run on the GPU: tiny random FLUX, images of three aspect ratios (so
sd-scripts' buckets feed the compiled blocks three shapes), a sample rendered mid-run (the blocks called under
no_grad between training steps). The run must finish, every compiled block must replay from CUDA graphs, and the
per-step losses must match the same run without graphs (replaying a graph runs the same kernels)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from flux_trainer.config import ConfigError
from flux_trainer.sdscripts.checkout import locate
from tests.conftest import make_images, write_dataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sd_scripts,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)"),
]

SIZES = [(256, 256), (320, 192), (192, 320)]  # three buckets at resolution 256 (cycled over the images)
STEPS = 9


def losses(run_dir) -> list[float]:
    from flux_trainer.metrics.tensorboard import read_scalars

    scalars = {}
    for d in {p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")}:
        scalars.update(read_scalars(d))
    return [v for _, v in scalars["loss/current"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    try:
        locate()
    except ConfigError as exc:
        pytest.skip(f"needs an sd-scripts checkout: {exc}")
    work = tmp_path_factory.mktemp("graphs")
    images = make_images(work / "pics", n=6, size=SIZES)
    write_dataset(work / "configs", "panels", images, resolution=256, repeats=1, min_bucket_reso=128,
                  max_bucket_reso=512)  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("FLUX_TRAIN_TOKENIZER_DIR", None)
    base = [
        "+dataset=panels",
        "model=random_tiny",
        "optimizer=adamw",
        f"train.max_steps={STEPS}",
        "train.save_every_n_steps=null",
        "train.save_state=false",
        "sample.prompts=[a flat colour panel]",
        "sample.every_n_steps=4",
        "sample.steps=2",
        "sample.width=128",
        "sample.height=128",
    ]
    out = {}
    for graphs in ("false", "true"):
        name = f"graphs_{graphs}"
        cmd = [sys.executable, "-m", "flux_trainer.cli", *base, f"train.output_name={name}"]
        cmd.append(f"kernels.cuda_graphs={graphs}")
        if shutil.which("flux-train"):
            cmd = [shutil.which("flux-train"), *cmd[3:]]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        found = sorted((work / "runs" / name).glob("*"))
        out[graphs] = (proc, found[-1] if found else None)
    return out


def test_both_runs_finish(runs):
    for graphs, (proc, run_dir) in runs.items():
        assert proc.returncode == 0, f"cuda_graphs={graphs}:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
        assert run_dir is not None and sorted((run_dir / "sample").glob("*.png")), "no sample rendered"


def test_every_compiled_block_replays_from_graphs(runs):
    from flux_trainer.metrics.tensorboard import read_texts

    run_dir = runs["true"][1]
    texts = {}
    for d in {p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")}:
        texts.update(read_texts(d))
    assert texts["run/kernels"].endswith("compile_blocks, cuda_graphs"), texts["run/kernels"]
    log = " ".join(re.sub(r"\S+\.py:\d+", " ", (run_dir / "train.log").read_text()).split())  # rich wraps lines
    assert "cuda graphs: every compiled block replays from CUDA graphs" in log, log[-3000:]


def test_losses_match_the_run_without_graphs(runs):
    plain, graphs = losses(runs["false"][1]), losses(runs["true"][1])
    assert len(plain) == len(graphs) == STEPS
    diff = sum(abs(a - b) / abs(a) for a, b in zip(plain, graphs, strict=True)) / STEPS
    assert diff < 1e-3, (plain, graphs)
