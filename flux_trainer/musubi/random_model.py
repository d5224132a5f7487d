"""Random-weight model sets for musubi-tuner (FLUX.2 [klein], FLUX.1 Kontext) for demos, tests and benchmarks.

No real weights can be downloaded here, yet the musubi-tuner backend must run end to end and be measured at full
size. So we write files that musubi-tuner's own loaders read like the real ones: the FLUX.2 DiT and AE in BFL key
layout and the Qwen3 text encoder as a transformers state dict without `lm_head` (the loader ties it), all bf16.
Key names and shapes come from the very classes musubi-tuner builds (on the meta device), never from a list, and
the writer is sd-scripts' streaming one (`flux_trainer.sdscripts.random_model.write_part`), so a full 4B set never
needs a second copy in host RAM. Kontext needs nothing new: its presets are sd-scripts' random sets.

musubi-tuner hard-codes each model's shape (klein 4B's `Klein4BParams`, FLUX.1-dev's `configs_flux_dev_context`,
Qwen3/CLIP/T5 configs as literals inside its loaders) and fetches tokenizers by hub id. `install_random_model`
is the one place that changes that, at run time in the process that runs musubi-tuner, never in the checkout:
it swaps the preset's shapes into those tables and config classes (tiny presets only) and points the tokenizer
ids at the stand-ins shipped in flux_trainer/standin_tokenizers (every random preset). `uninstall_random_model`
puts everything back.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flux_trainer.config.errors import ConfigError
from flux_trainer.config.random_specs import PRESETS as SDSCRIPTS_PRESETS
from flux_trainer.musubi.random_specs import (
    FLUX2_PARTS,
    FLUX2_PRESETS,
    KONTEXT_PRESETS,
    flux2_needs_patch,
    flux2_preset_file,
    preset_family,
)
from flux_trainer.sdscripts.random_model import NOTE, SPEC_FILE, TensorPlan, plan_part, write_parts

_log = logging.getLogger(__name__)

STANDIN_DIR = Path(__file__).resolve().parents[1] / "standin_tokenizers"
CLIP_L_STANDIN = "openai_clip-vit-large-patch14"
T5_STANDIN = "google_t5-v1_1-xxl"
# The settings of musubi-tuner's hard-coded Qwen3-4B config (zimage_utils.load_qwen3) other than the preset's shape
# fields; a test compares the built config with the one musubi-tuner builds.
QWEN3_BASE: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# the hub ids musubi-tuner's loaders fetch, and the stand-in folder each one gets for a random set
QWEN3_TOKENIZER_IDS = ("Qwen/Qwen3-4B", "Qwen/Qwen3-8B")
CLIP_L_TOKENIZER_ID = "openai/clip-vit-large-patch14"
T5_TOKENIZER_ID = "google/t5-v1_1-xxl"


def _mod(name: str) -> Any:
    """A musubi-tuner module, imported from the checkout already on sys.path (the backend's checkout module puts
    it there). torchvision-less CPU builds get sd-scripts' shim first: musubi-tuner's trainer imports torchvision."""
    from flux_trainer.sdscripts.checkout import install_torchvision_shim

    install_torchvision_shim()
    try:
        return importlib.import_module(f"musubi_tuner.{name}")
    except ImportError as exc:
        raise ConfigError(
            f"musubi-tuner is not importable ({exc}); run `flux-train setup` or set FLUX_TRAIN_MUSUBI_TUNER to a "
            f"checkout and put its src/ on the path"
        ) from exc


# ------------------------------------------------------------------------------------- runtime patches (musubi)

_ATTRS: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(owner), name) -> (owner, original value)
_ITEMS: dict[tuple[int, str], tuple[dict, Any]] = {}  # (id(mapping), key) -> (mapping, original value)


def _original(owner: Any, name: str) -> Any:
    return _ATTRS.get((id(owner), name), (owner, getattr(owner, name)))[1]


def _original_item(mapping: dict, key: str) -> Any:
    return _ITEMS.get((id(mapping), key), (mapping, mapping[key]))[1]


def _set_attr(owner: Any, name: str, value: Any) -> None:
    _ATTRS.setdefault((id(owner), name), (owner, getattr(owner, name)))
    setattr(owner, name, value)


def _set_item(mapping: dict, key: str, value: Any) -> None:
    _ITEMS.setdefault((id(mapping), key), (mapping, mapping[key]))
    mapping[key] = value


def uninstall_random_model() -> None:
    """Undo every `install_random_model` change (tests; a process that goes on to load real models)."""
    for (_, name), (owner, value) in list(_ATTRS.items()):
        setattr(owner, name, value)
    for (_, key), (mapping, value) in list(_ITEMS.items()):
        mapping[key] = value
    _ATTRS.clear()
    _ITEMS.clear()


def _redirecting(cls: type, load_cls: type, folders: dict[str, Path]) -> type:
    """`cls` whose from_pretrained reads the stand-in folder for the hub ids in `folders` (with `load_cls`: the
    T5 stand-in has only the fast tokenizer's file) and anything else as before."""

    class Redirected(cls):
        @classmethod
        def from_pretrained(klass, name, *args, **kwargs):  # noqa: N804 - mirrors transformers' signature
            folder = folders.get(str(name))
            if folder is None:
                return cls.from_pretrained(name, *args, **kwargs)
            kwargs.pop("subfolder", None)
            return load_cls.from_pretrained(str(folder), *args, **kwargs)

    Redirected.__name__ = Redirected.__qualname__ = cls.__name__
    return Redirected


def _with_shapes(config_cls: type, shapes: dict[str, Any]) -> Callable[..., Any]:
    """The config class musubi-tuner calls with its literal dict, the preset's shape fields winning."""

    @functools.wraps(config_cls)
    def make(*args: Any, **kwargs: Any) -> Any:
        return config_cls(*args, **{**kwargs, **shapes})

    return make


def install_random_model(dit_path: str | Path) -> list[str]:
    """Prepare this process's musubi-tuner to read the random set whose DiT file is `dit_path` (its spec.json lies
    beside it); returns what was changed, one line each, for the log. A file that is not one of our random sets
    changes nothing. Idempotent: a second call re-derives every patch from the originals."""
    spec_path = Path(dit_path).parent / SPEC_FILE
    if not spec_path.is_file():
        return []
    spec = json.loads(spec_path.read_text())
    if not spec.get("random_weights"):
        return []
    if spec.get("family") == "flux2":
        return _install_flux2(spec)
    if spec.get("model_type", "flux") == "flux" and "t5xxl" in spec:
        return _install_kontext(spec)
    raise ConfigError(
        f"{dit_path} is a random {spec.get('model_type')} set, which musubi-tuner does not train; "
        f"use a random_flux2_* or random_kontext* preset"
    )


def _install_flux2(spec: dict[str, Any]) -> list[str]:
    zimage_utils = _mod("zimage.zimage_utils")
    flux2_utils, flux2_models = _mod("flux_2.flux2_utils"), _mod("flux_2.flux2_models")
    from transformers import Qwen2Tokenizer

    folder = STANDIN_DIR / spec["tokenizer"]
    redirected = _redirecting(Qwen2Tokenizer, Qwen2Tokenizer, dict.fromkeys(QWEN3_TOKENIZER_IDS, folder))
    _set_attr(zimage_utils, "Qwen2Tokenizer", redirected)
    done = [f"Qwen3 tokenizer ids -> stand-in {folder.name}"]
    if not flux2_needs_patch(spec):
        return done
    version = spec["model_version"]
    info = _original_item(flux2_utils.FLUX2_MODEL_INFO, version)
    params = dataclasses.replace(info.params, **spec["dit"])
    _set_item(flux2_utils.FLUX2_MODEL_INFO, version, dataclasses.replace(info, params=params))
    ae_params = functools.partial(_original(flux2_models, "AutoEncoderParams"), **spec["vae"])
    _set_attr(flux2_models, "AutoEncoderParams", ae_params)
    _set_attr(zimage_utils, "Qwen3Config", _with_shapes(_original(zimage_utils, "Qwen3Config"), spec["text_encoder"]))
    return [*done, f"FLUX.2 {version}: DiT, AE and Qwen3 shapes of {spec['preset']}"]


def _install_kontext(spec: dict[str, Any]) -> list[str]:
    flux_utils, flux_models = _mod("flux.flux_utils"), _mod("flux.flux_models")
    from transformers import CLIPTokenizer, T5Tokenizer, T5TokenizerFast

    clip_dir, t5_dir = STANDIN_DIR / CLIP_L_STANDIN, STANDIN_DIR / T5_STANDIN
    _set_attr(flux_utils, "CLIPTokenizer", _redirecting(CLIPTokenizer, CLIPTokenizer, {CLIP_L_TOKENIZER_ID: clip_dir}))
    _set_attr(flux_utils, "T5Tokenizer", _redirecting(T5Tokenizer, T5TokenizerFast, {T5_TOKENIZER_ID: t5_dir}))
    done = ["CLIP-L and T5 tokenizer ids -> stand-ins"]
    full = SDSCRIPTS_PRESETS["full"]
    if all(spec[part] == full[part] for part in ("flux", "ae", "clip_l", "t5xxl")):
        return done
    base = _original(flux_models, "configs_flux_dev_context")
    flux_shapes = {k: v for k, v in spec["flux"].items() if k in {f.name for f in dataclasses.fields(base.params)}}
    params = dataclasses.replace(base.params, **flux_shapes)
    model_spec = dataclasses.replace(base, params=params, ae_params=dataclasses.replace(base.ae_params, **spec["ae"]))
    _set_attr(flux_models, "configs_flux_dev_context", model_spec)
    _set_attr(flux_utils, "CLIPConfig", _with_shapes(_original(flux_utils, "CLIPConfig"), spec["clip_l"]))
    t5 = {**spec["t5xxl"], "num_decoder_layers": spec["t5xxl"]["num_layers"]}
    _set_attr(flux_utils, "T5Config", _with_shapes(_original(flux_utils, "T5Config"), t5))
    return [*done, f"FLUX.1 Kontext: DiT, AE, CLIP-L and T5 shapes of sd-scripts' {spec.get('preset')} set"]


# ---------------------------------------------------------------------------------------------- FLUX.2 modules


def build_flux2_empty(part: str, shapes: dict[str, Any]) -> torch.nn.Module:
    """One FLUX.2 part with its parameters on the meta device (no memory), from musubi-tuner's classes with the
    preset's shapes over klein 4B's, so the fields a preset does not name (theta, AE resolution) are musubi-tuner's
    (the text encoder: the preset's fields, tie_word_embeddings included for the 8B, over QWEN3_BASE)."""
    from accelerate import init_empty_weights

    flux2_models = _mod("flux_2.flux2_models")
    with init_empty_weights():
        if part == "dit":
            return flux2_models.Flux2(dataclasses.replace(flux2_models.Klein4BParams(), **shapes))
        if part == "vae":
            return flux2_models.AutoEncoder(
                dataclasses.replace(_original(flux2_models, "AutoEncoderParams")(), **shapes)
            )
        if part == "text_encoder":
            from transformers import Qwen3Config, Qwen3ForCausalLM

            return Qwen3ForCausalLM._from_config(Qwen3Config(**{**QWEN3_BASE, **shapes}))
    raise KeyError(f"unknown FLUX.2 model part {part!r}; choose from {', '.join(FLUX2_PARTS)}")


def plan_flux2_part(part: str, shapes: dict[str, Any]) -> list[TensorPlan]:
    """What the part's file holds. Two changes to sd-scripts' fills: the AE's BatchNorm statistics are mean 0 and
    variance 1 (random ones would be negative: NaN latents), and the text encoder has no `lm_head.weight`, as in
    the released files: musubi-tuner's loader ties it to the embedding."""
    plans = plan_part(build_flux2_empty(part, shapes))
    stats = {"running_mean": "zeros", "running_var": "ones", "num_batches_tracked": "zeros"}
    plans = [dataclasses.replace(p, fill=stats.get(p.name.rsplit(".", 1)[-1], p.fill)) for p in plans]
    return [p for p in plans if not (part == "text_encoder" and p.name == "lm_head.weight")]


def _flux2_paths(cache: Path, preset: str) -> dict[str, Path]:
    paths = {part: flux2_preset_file(cache, preset, part) for part in FLUX2_PARTS}
    return {**paths, "tokenizer": STANDIN_DIR / FLUX2_PRESETS[preset]["tokenizer"]}


def _ensure_flux2(cache: Path, preset: str, device: torch.device, seed: int, log: Callable[[str], None]) -> dict:
    paths = _flux2_paths(cache, preset)
    folder = paths["dit"].parent
    banner = f"RANDOM WEIGHTS (preset {preset}): for demos/tests/benchmarks, not a real model"
    if (folder / SPEC_FILE).is_file() and all(paths[p].is_file() for p in FLUX2_PARTS):
        log(f"{banner}; using {folder}")
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    shapes = FLUX2_PRESETS[preset]
    parts = {part: (paths[part], plan_flux2_part(part, shapes[part]), i) for i, part in enumerate(FLUX2_PARTS)}
    write_parts(preset, parts, len(FLUX2_PARTS), device, seed, {}, log)
    spec = {"preset": preset, "family": "flux2", "random_weights": True, "note": NOTE, "seed": seed, **shapes}
    tmp = folder / f"{SPEC_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / SPEC_FILE)
    return paths


def ensure_random_musubi_model(
    cache_dir: str | Path,
    preset: str,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    sd_scripts: str | None = None,
    log: Callable[[str], None] = _log.info,
) -> dict[str, Path]:
    """The files of a musubi-tuner random preset, generated on first use (on `device`: a GPU for the full sizes)
    and reused afterwards, keyed by the musubi-tuner argument each one goes to:
    FLUX.2: dit, vae, text_encoder, tokenizer (the stand-in folder);
    Kontext: dit, vae, text_encoder1 (T5), text_encoder2 (CLIP-L), tokenizer1, tokenizer2 (stand-in folders),
    made by sd-scripts' generator (`sd_scripts`: its checkout, else found as it finds it).
    Give the dit path to `install_random_model` in the process that runs musubi-tuner."""
    family = preset_family(preset)
    cache = Path(cache_dir)
    if family == "flux2":
        return _ensure_flux2(cache, preset, torch.device(device), seed, log)
    from flux_trainer.sdscripts.random_model import ensure_random_model

    made = ensure_random_model(cache, KONTEXT_PRESETS[preset], device=device, seed=seed, sd_scripts=sd_scripts, log=log)
    return {
        "dit": made["flux"],
        "vae": made["ae"],
        "text_encoder1": made["t5xxl"],
        "text_encoder2": made["clip_l"],
        "tokenizer1": STANDIN_DIR / T5_STANDIN,
        "tokenizer2": STANDIN_DIR / CLIP_L_STANDIN,
    }
