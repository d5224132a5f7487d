"""Plain sd-scripts on a run dir's TOMLs, for a random preset sd-scripts' own loaders cannot build.

`python -m tests.integration.plain_sd_scripts RUN_DIR OUT` runs the checkout's `flux_train_network.py` as its own
`__main__` (what `flux-train bench` runs as the baseline, without accelerate's launcher) with RUN_DIR's
sd_scripts.toml and dataset.toml, writing into OUT. Only two things are ours: torchvision's two transforms where
torchvision is missing (as the runner gives them), and sd-scripts' four model loaders answer with the preset's
modules (random_model.load_random_models, as the runner's load_target_model does), since they hard-code FLUX.1-dev's
widths. Nothing of our runner, hooks, kernels or seeding takes part: the reference our run is held against.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def use_preset_loaders(folder: Path, sd_scripts: str) -> None:
    """sd-scripts' flux_utils loaders return the preset's modules (built once per dtype), whatever path they get."""
    import torch
    from library import flux_utils

    from flux_trainer.sdscripts.random_model import load_random_models

    built: dict = {}

    def part(index: int, dtype) -> torch.nn.Module:
        dtype = dtype or torch.bfloat16
        if dtype not in built:
            built[dtype] = load_random_models(folder, dtype, "cpu", sd_scripts=sd_scripts)
        return built[dtype][index]

    flux_utils.load_clip_l = lambda path, dtype, device, *a, **kw: part(0, dtype)
    flux_utils.load_t5xxl = lambda path, dtype, device, *a, **kw: part(1, dtype)
    flux_utils.load_ae = lambda path, dtype, device, *a, **kw: part(2, dtype)
    flux_utils.load_flow_model = lambda path, dtype, device, *a, **kw: (False, part(3, dtype))


def main(run_dir: Path, out: Path) -> None:
    from flux_trainer.sdscripts.checkout import install_torchvision_shim

    spec = json.loads((run_dir / "runner.json").read_text())
    install_torchvision_shim()
    sys.path.insert(0, spec["sd_scripts"])
    if spec.get("random_model_dir"):
        use_preset_loaders(Path(spec["random_model_dir"]), spec["sd_scripts"])
    script = Path(spec["sd_scripts"]) / "flux_train_network.py"
    sys.argv = [str(script), "--config_file", spec["train_toml"], "--dataset_config", spec["dataset_toml"],
                "--output_dir", str(out), "--logging_dir", str(out / "tb")]  # fmt: skip
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
