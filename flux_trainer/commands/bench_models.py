"""What `flux-train bench` needs to know of the model it benches: which trainer trains it (so which plain trainer runs
beside ours, and what its row is called), the memory tiers it is proven on with `--tiers`, and the targets its tier
rows are held to. The model is named by its preset (`--model random_flux2_klein_4b`), read from its YAML without
composing a run; the trainer comes from the backend seam (flux_trainer.backend), as everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flux_trainer.backend import SDSCRIPTS, TRAINER_NAMES, backend_for

# the plain trainer's row: "<our case> (plain sd-scripts)" / "(plain musubi-tuner)"
PLAIN_SUFFIXES = {backend: f"(plain {name})" for backend, name in TRAINER_NAMES.items()}

# issue 61's tiers for FLUX.2 [klein]: 4B on 8, 12 and 16 GB cards, 9B on 12, 16 and 24 GB (`--tiers` with no names).
# Other models (FLUX.1, Chroma, Kontext, FLUX.2 dev) get every tier.
MODEL_TIERS: dict[str, tuple[str, ...]] = {
    "klein-4b": ("vram8", "vram12", "vram16"),
    "klein-base-4b": ("vram8", "vram12", "vram16"),
    "klein-9b": ("vram12", "vram16", "vram24"),
    "klein-base-9b": ("vram12", "vram16", "vram24"),
}

# The least speed-up over plain musubi-tuner on the same TOMLs (issue 61: 1.5x for klein base 4B and for Kontext),
# by (model_type, model_version); None: any version. Models trained on musubi-tuner have no s/step target: the tier
# targets in seconds (bench.TIER_TARGETS) are FLUX.1-dev's and mean nothing for a 4B or 9B model.
MUSUBI_RATIO_TARGETS: dict[tuple[str, str | None], float] = {("flux2", "klein-base-4b"): 1.5, ("kontext", None): 1.5}


@dataclass(frozen=True)
class BenchModel:
    name: str
    model_type: str = "flux"
    model_version: str | None = None

    @property
    def backend(self) -> str:
        return backend_for(self.model_type)

    @property
    def plain_suffix(self) -> str:
        return PLAIN_SUFFIXES[self.backend]


def bench_model(name: str, search_dirs: list[Path] | None = None) -> BenchModel:
    """The model preset `name` as its YAML (the shipped configs/model/ first, then the user's config folders) says;
    a name found nowhere is FLUX.1 (compose refuses it later with its own message)."""
    from omegaconf import OmegaConf

    from flux_trainer.config.paths import shipped_config_dir, user_config_dirs

    for folder in [shipped_config_dir(), *(user_config_dirs() if search_dirs is None else search_dirs)]:
        path = Path(folder) / "model" / f"{name}.yaml"
        if path.is_file():
            model = OmegaConf.load(path).get("model") or {}
            version = model.get("model_version")
            return BenchModel(name, str(model.get("model_type") or "flux"), None if version is None else str(version))
    return BenchModel(name)


def default_tiers(model: BenchModel) -> tuple[str, ...] | None:
    """The tiers `--tiers` runs for this model when none are named (None: every tier)."""
    return MODEL_TIERS.get(model.model_version or "") if model.model_type == "flux2" else None


def tier_target(
    model_type: str | None, model_version: str | None, flux1_target: tuple[float | None, float | None]
) -> tuple[float | None, float | None]:
    """(s/step target, least ratio over the plain trainer) of one tier row: FLUX.1's own (`flux1_target`) for a model
    sd-scripts trains (a result without a model type is one, from before the field); for musubi-tuner's models no
    s/step target and issue 61's ratio where it names one."""
    if model_type is None or backend_for(model_type) == SDSCRIPTS:
        return flux1_target
    ratio = MUSUBI_RATIO_TARGETS.get((model_type, model_version), MUSUBI_RATIO_TARGETS.get((model_type, None)))
    return None, ratio


def plain_base(case: str) -> str | None:
    """Our case's name where `case` is a plain trainer's row, else None."""
    for suffix in PLAIN_SUFFIXES.values():
        if case.endswith(suffix):
            return case.removesuffix(suffix).rstrip()
    return None


def plain_trainer(case: str) -> str | None:
    """The plain trainer's name ('sd-scripts', 'musubi-tuner') where `case` is its row, else None."""
    for backend, suffix in PLAIN_SUFFIXES.items():
        if case.endswith(suffix):
            return TRAINER_NAMES[backend]
    return None
