"""`kernels=` on musubi-tuner's FLUX.2 through a real run on the CPU (issue 61's Speed): named, compile_blocks checks
one block of each kind compiled against eager, compiles every block from our runner (not the TOML: the baseline
trains plain musubi-tuner on the same TOML), and trains to the losses kernels=off trains to; off installs nothing.
The two runs draw the same noise (the probe puts the RNG state back), so their losses differ only by the compiled
blocks' bf16 rounding. (Checkpointed blocks are probed in tests/unit/test_musubi_block_compile.py: a CPU compile of
the preset's blocks in bf16 takes minutes.)"""

from __future__ import annotations

import pytest
import tomllib

from flux_trainer.metrics.tensorboard import read_texts
from flux_trainer.musubi.block_compile import compiler_available
from tests.integration.test_musubi_cpu import check_run, musubi_env, need_checkouts
from tests.integration.tiny_run import flux_train, newest_run, tiny_dataset

pytestmark = [pytest.mark.musubi, pytest.mark.sd_scripts]
COMMON = ("+dataset=tiny", "model=random_flux2_klein_tiny", "train.max_steps=2")


def train(work, kernel_set: str) -> tuple[str, str, dict]:
    got = flux_train(work, *COMMON, f"kernels={kernel_set}", env=musubi_env(work))
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    scalars = check_run(work, "networks.lora_flux_2", "flux_2_klein_4b")
    run = newest_run(work)
    with open(run / "musubi_tuner.toml", "rb") as f:
        keys = [k for table in tomllib.load(f).values() for k in table]
    assert keys and not [k for k in keys if "compile" in k]  # the speed-up is the runner's, never the TOML's
    return got.stdout, (run / "train.log").read_text(), scalars


def test_compile_blocks_is_checked_installed_and_trains_to_kernels_offs_losses(tmp_path):
    need_checkouts()
    import torch

    ok, why = compiler_available(torch.device("cpu"))
    if not ok:
        pytest.skip(f"torch.compile cannot build here: {why}")
    tiny_dataset(tmp_path)
    out, log, plain = train(tmp_path, "off")
    assert "kernels: off (plain musubi-tuner compute path)" in out
    assert "kernels: off (plain musubi-tuner compute path)" in log and "installing" not in log

    out, log, compiled = train(tmp_path, "compile")
    assert "kernels: compile_blocks (regional torch.compile" in out
    assert "kernels: installing compile_blocks: 1 double + 1 single blocks; double block matches eager" in log
    assert "single block matches eager, fwd+bwd (bfloat16" in log and "kernels: compile_blocks\n" in log
    (events,) = {p.parent for p in (newest_run(tmp_path) / "tb").rglob("events.out.tfevents.*")}
    assert "compile_blocks" in read_texts(events)["run/kernels"]
    want = [v for _, v in plain["loss/current"]]
    got = [v for _, v in compiled["loss/current"]]
    assert got == pytest.approx(want, rel=1e-2), (got, want)  # bf16 blocks, fused differently


def test_a_named_kernel_for_flux1_is_refused_before_anything_is_made(tmp_path):
    need_checkouts()
    tiny_dataset(tmp_path)
    got = flux_train(tmp_path, *COMMON, "kernels=fused", env=musubi_env(tmp_path))
    assert got.returncode == 2, got.stdout[-2000:] + got.stderr[-2000:]
    assert "do not apply to musubi-tuner's FLUX.2 / Kontext" in got.stderr + got.stdout
    assert "Traceback" not in got.stderr and newest_run(tmp_path) is None
