"""`flux-train demo` as a new user runs it, on the CPU: a short header, one progress line, a summary naming the LoRA;
at most 60 lines, none twice, no path broken across lines, sd-scripts' own output in train.log."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.sdscripts.checkout import locate

pytestmark = pytest.mark.sd_scripts


def test_the_demo_prints_a_page_not_a_log(tmp_path):
    try:
        checkout = locate()
    except ConfigError as exc:
        pytest.skip(f"needs an sd-scripts checkout: {exc}")
    env = {k: v for k, v in os.environ.items() if k not in ("FLUX_TRAIN_TOKENIZER_DIR", "FLUX_TRAIN_VERBOSE")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", FLUX_TRAIN_CACHE=str(tmp_path / "cache"))
    env.update(FLUX_TRAIN_SD_SCRIPTS=str(checkout.path), COLUMNS="80")
    exe = shutil.which("flux-train")
    cmd = [exe, "demo"] if exe else [sys.executable, "-m", "flux_trainer.cli", "demo"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= 60, "\n".join(lines)
    twice = [line for line, n in Counter(lines).items() if n > 1]
    assert not twice, twice
    lora = Path(next(line for line in lines if line.startswith("[flux-train] LoRA: ")).split(": ", 1)[1])
    assert lora.is_file() and lora.suffix == ".safetensors"
    # every path printed whole: it exists (or its parent does)
    for path in re.findall(r"(?<![\w/.])(/[\w.-]+(?:/[\w.-]+)+)", proc.stdout):
        assert Path(path).exists() or Path(path).parent.exists(), path
    assert "Traceback" not in proc.stdout + proc.stderr and "steps:" not in proc.stdout  # sd-scripts' bar is logged
    log = (lora.parent / "train.log").read_text()
    assert "steps:" in log and "Loading settings from" in log  # sd-scripts' output went to the log
    assert re.search(r"^step 4/4 ", proc.stdout, re.M) and "done in" in proc.stdout
