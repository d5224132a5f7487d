"""Plain musubi-tuner on a flux-train run's own files: the reference `flux-train bench --baseline` measures a FLUX.2
or Kontext run against, as plain sd-scripts is for FLUX.1.

The command is `accelerate launch` (the run's own accelerate.yaml) of musubi-tuner's training script from the
checkout named in the run's runner.json, with the run's training TOML and dataset TOML and nothing else of ours: no
runner, no trainer subclass, no hooks, no kernels. Only its output and TensorBoard folders move, to the run's
`baseline/` (command-line flags win over the TOML's in musubi-tuner's read_config_from_file).

The script is started through `flux_trainer.musubi.script`, the launcher our run's own caching steps use: it puts
the checkout's `src` on the path, gives a CPU build without a matching torchvision the names musubi-tuner imports
(flux_trainer.backend.tv_shim), and for a random preset teaches musubi-tuner's loaders the preset's shapes and
stand-in tokenizers (flux_trainer.musubi.random_model; full-size presets need only the tokenizers, which training
from caches never loads). Then it calls the script's own `main()`, which builds musubi-tuner's own trainer class.

Caching is NOT run again: musubi-tuner trains from the latents and text-encoder outputs cached before training, and
the dataset TOML names the cache folders our run filled (its cache_directory), so plain musubi-tuner reads exactly
the caches our run trained from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPT_MODULE = "flux_trainer.musubi.script"


def plain_command(run_dir: Path, out: Path) -> list[str]:
    """The command line of plain musubi-tuner's training on the run's TOMLs, its output and TensorBoard under `out`."""
    spec = json.loads((Path(run_dir) / "runner.json").read_text())
    random = ["--random-model", spec["random_dit"]] if spec.get("random_dit") else []
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(Path(run_dir) / "accelerate.yaml"),
        "--quiet",
        "-m",
        SCRIPT_MODULE,
        *random,
        spec["musubi_tuner"],
        spec["scripts"][2],  # the training script (the first two are the caching scripts, not run again)
        "--config_file",
        spec["train_toml"],
        "--dataset_config",
        spec["dataset_toml"],
        "--output_dir",
        str(out),
        "--logging_dir",
        str(Path(out) / "tb"),
    ]
