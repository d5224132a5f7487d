"""The backend seam: which trainer a model trains on, and what is shared between the trainers' folders.

A model preset's `model.model_type` names its architecture; the architecture names the backend. Only this table
knows both names: `flux_trainer/sdscripts/` (kohya-ss sd-scripts: FLUX.1, Chroma) and `flux_trainer/musubi/`
(kohya-ss musubi-tuner: FLUX.2, FLUX.1 Kontext). Config, launch and metrics read `backend_for` and nothing else of
the trainers.
"""

from __future__ import annotations

SDSCRIPTS = "sdscripts"
MUSUBI = "musubi"
# model.model_type -> the backend that trains it
BACKENDS: dict[str, str] = {"flux": SDSCRIPTS, "chroma": SDSCRIPTS, "flux2": MUSUBI, "kontext": MUSUBI}
TRAINER_NAMES = {SDSCRIPTS: "sd-scripts", MUSUBI: "musubi-tuner"}


def backend_for(model_type: str) -> str:
    """The backend of a model type; KeyError names the known ones."""
    try:
        return BACKENDS[model_type]
    except KeyError:
        raise KeyError(f"unknown model_type {model_type!r}; choose from {', '.join(BACKENDS)}") from None
