"""The tiny random Chroma trained 2 steps on the CPU with kernels=auto and with kernels=off, two images a step whose
captions differ in length (so chroma_blocks masks padding): auto installs chroma_blocks (the run log says so) and
trains with the losses and the LoRA of plain sd-scripts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integration.tiny_run import flux_train, need_checkout, newest_run, tiny_dataset

pytestmark = pytest.mark.sd_scripts


def losses(run_dir) -> list[float]:
    from flux_trainer.metrics.tensorboard import read_scalars

    return [v for _, v in read_scalars(next((run_dir / "tb").rglob("events.out.tfevents.*")).parent)["loss/current"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    need_checkout()
    work = tmp_path_factory.mktemp("e2e_chroma_kernels")
    images = tiny_dataset(work, name="tinyck", n=2)
    (images / "im0.txt").write_text("red")
    (images / "im1.txt").write_text("a flat colour square with a much longer caption than the first one has")
    common = ("+dataset=tinyck", "model=random_chroma_tiny", "train.max_steps=2", "train.batch_size=2",
              "train.data_loader_workers=0", "memory=cpu", "sample.prompts=[]")  # fmt: skip
    out = {}
    for kernels in ("auto", "off"):
        proc = flux_train(work, *common, f"kernels={kernels}", f"train.output_name=k{kernels}")
        run = newest_run(work, f"k{kernels}")  # runs/<output name>/<time>
        out[kernels] = SimpleNamespace(proc=proc, run_dir=run)
    return out


def test_auto_installs_chroma_blocks_and_says_so(runs):
    proc, run_dir = runs["auto"].proc, runs["auto"].run_dir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    # the log's lines are wrapped to the console's width
    assert "flux_kernels installed chroma_blocks:" in log and "1 double + 1 single Chroma blocks" in log
    assert "kernel chroma_blocks skipped" not in log and "failed verification" not in log
    assert log.count("kernel selective_checkpoint") == 1  # what cannot apply here still says why, once


def test_auto_trains_like_plain_sd_scripts(runs):
    from safetensors.torch import load_file

    for r in runs.values():
        assert r.proc.returncode == 0, r.proc.stdout[-3000:] + r.proc.stderr[-3000:]
    auto, off = runs["auto"].run_dir, runs["off"].run_dir
    assert auto != off and "chroma_blocks" not in (off / "train.log").read_text()
    assert losses(auto) == pytest.approx(losses(off), rel=1e-4) and len(losses(auto)) == 2
    want, got = load_file(off / "koff.safetensors"), load_file(auto / "kauto.safetensors")
    assert want.keys() == got.keys()
    for key, w in want.items():  # saved in bf16: the two runs' weights land on either side of a rounding here and there
        w, g = w.float(), got[key].float()
        assert ((g - w).norm() / w.norm().clamp_min(1e-30)).item() <= 1e-2, key
