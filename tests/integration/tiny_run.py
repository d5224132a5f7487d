"""A CPU run of a tiny random model through `flux-train`, as a user runs it: the sd-scripts checkout (or why there is
none), a working folder with generated captioned squares and a dataset config, a fresh machine's environment, the CLI.
Shared by the CPU end-to-end tests (tests/integration/test_*_cpu.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.sdscripts.checkout import locate

try:
    CHECKOUT = locate()
except ConfigError as exc:  # pragma: no cover - depends on the machine
    CHECKOUT, WHY = None, str(exc)
else:
    WHY = ""


def need_checkout() -> None:
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")


def tiny_dataset(work: Path, name: str = "tiny", n: int = 4, extra: str = "") -> Path:
    """`n` flat-colour 128² squares with captions in work/pics, and work/configs/dataset/NAME.yaml naming them at
    128 px (`extra`: more YAML lines). Returns the images' folder."""
    from PIL import Image

    images = work / "pics"
    images.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (128, 128), (50 * i % 256, 90, 160)).save(images / f"im{i}.png")
        (images / f"im{i}.txt").write_text(f"a flat colour square number {i}")
    (work / "configs" / "dataset").mkdir(parents=True)
    (work / "configs" / "dataset" / f"{name}.yaml").write_text(
        f"name: {name}\nimages: {images}\nresolution: 128\nrepeats: 1\nmin_bucket_reso: 64\nmax_bucket_reso: 256\n"
        + extra
    )
    return images


def fresh_env(work: Path) -> dict[str, str]:
    """A fresh machine's: no GPU, no hub, a cache folder of its own (the random model, hashes ...), the stand-in
    tokenizers of the random presets (no tokenizer or model folder configured), the checkout found above."""
    env = {k: v for k, v in os.environ.items() if k not in ("FLUX_TRAIN_TOKENIZER_DIR", "FLUX_TRAIN_MODEL_CACHE")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", FLUX_TRAIN_CACHE=str(work / "cache"))
    env.update(FLUX_TRAIN_SD_SCRIPTS=str(CHECKOUT.path))
    return env


def cli(*args: str) -> list[str]:
    """The installed `flux-train`, or the module where the console script is not on PATH."""
    exe = shutil.which("flux-train")
    return [exe, *args] if exe else [sys.executable, "-m", "flux_trainer.cli", *args]


def flux_train(work: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), cwd=work, env=env or fresh_env(work), capture_output=True, text=True,
                          timeout=900)  # fmt: skip


def newest_run(work: Path, name: str = "tiny") -> Path | None:
    runs = sorted((work / "runs" / name).glob("*"))
    return runs[-1] if runs else None


def state_step(path: Path) -> int:
    """The step in a state folder's name: tiny-step00000005-state -> 5."""
    import re

    return int(re.fullmatch(r"tiny-step(\d{8})-state", path.name).group(1))


def run_scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """step -> value of `tag` across the run dir's TensorBoard events."""
    from flux_trainer.metrics.tensorboard import read_scalars

    out: dict[int, float] = {}
    for events in {p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")}:
        out.update(dict(read_scalars(events).get(tag, [])))
    return out


def interrupted_run(command: list[str], root: Path, env: dict[str, str], after: int) -> subprocess.CompletedProcess:
    """Run `command` in `root` and press Ctrl-C (SIGINT to flux-train) once a state of a step after `after` exists;
    the test fails (and kills it) on a timeout."""
    import signal
    import time

    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if [p for p in root.glob("runs/tiny/*/tiny-step*-state") if state_step(p) > after]:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.2)
    try:
        out, err = proc.communicate(timeout=600)
    except BaseException:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
