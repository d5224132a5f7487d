"""The named captioners: where each comes from, what it loads as, what it costs. Pure data and path arithmetic.

The default is Qwen2.5-VL-3B-Instruct: docs/captioning.md says why, and that caption quality was not measured
here. Weight shards are not listed: `model.safetensors.index.json` names them, and the download reads it first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flux_trainer.config import ConfigError
from flux_trainer.config.paths import model_cache

DEFAULT = "qwen2.5-vl-3b"
RANDOM_TINY = "random_tiny"
INDEX = "model.safetensors.index.json"

# Files every Qwen2.5-VL-Instruct repository carries besides its weights.
_QWEN_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    INDEX,
)
# Where the chat template may be (else tokenizer_config.json carries it).
_TEMPLATES = ("chat_template.json", "chat_template.jinja")


@dataclass(frozen=True)
class CaptionerSpec:
    name: str
    family: str  # how it loads and how a prompt is built: "qwen2_5_vl" or "llava"
    repo_id: str | None  # None: built here (random_tiny), nothing to download
    revision: str  # "main": not pinned to a commit (see docs/captioning.md)
    files: tuple[str, ...]  # needed besides the weight shards
    optional: tuple[str, ...]  # fetched when the repository has them
    params_b: float  # parameters, billions
    bf16_gb: float  # its weights in bf16, GB: about what the GPU needs before activations
    max_new_tokens: int  # a one-paragraph caption fits; bounds a model that never stops
    note: str

    @property
    def downloads(self) -> bool:
        return self.repo_id is not None


CAPTIONERS: dict[str, CaptionerSpec] = {
    spec.name: spec
    for spec in (
        CaptionerSpec(
            "qwen2.5-vl-3b",
            "qwen2_5_vl",
            "Qwen/Qwen2.5-VL-3B-Instruct",
            "main",
            _QWEN_FILES,
            _TEMPLATES,
            3.75,
            7.5,
            300,
            "default: fits a 12 GB card; the family musubi-tuner and SimpleTuner caption with",
        ),
        CaptionerSpec(
            "qwen2.5-vl-7b",
            "qwen2_5_vl",
            "Qwen/Qwen2.5-VL-7B-Instruct",
            "main",
            _QWEN_FILES,
            _TEMPLATES,
            8.29,
            16.6,
            300,
            "Qwen's larger model: better on Qwen's published benchmarks, needs a 24 GB card",
        ),
        CaptionerSpec(
            "joycaption",
            "llava",
            "fancyfeast/llama-joycaption-beta-one-hf-llava",
            "main",
            ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", INDEX),
            ("preprocessor_config.json", "processor_config.json", "special_tokens_map.json", *_TEMPLATES),
            8.48,
            17.0,
            300,
            "JoyCaption Beta One (Llama 3.1 8B + SigLIP): trained for diffusion captions, uncensored; 24 GB card",
        ),
        CaptionerSpec(
            RANDOM_TINY,
            "qwen2_5_vl",
            None,
            "",
            (),
            (),
            0.0001,
            0.0,
            24,
            "random weights of the default's class, built here: nonsense captions, for tests and the CPU demo",
        ),
    )
}

# Asked for by name, not offered: one line saying why, instead of "unknown".
NOT_OFFERED = {
    "florence-2-large": "Florence-2 runs only with its repository's own code (trust_remote_code) in the transformers "
    "this project pins (<4.56), and flux-train does not run downloaded code",
    "qwen3-vl": "Qwen3-VL needs transformers 4.57 or newer; this project pins transformers <4.56 (sd-scripts' range)",
}


def resolve(name: str | None) -> CaptionerSpec:
    """The captioner called `name` (None: the default); an unknown name lists the known ones."""
    name = name or DEFAULT
    spec = CAPTIONERS.get(name)
    if spec is not None:
        return spec
    known = ", ".join(CAPTIONERS)
    for refused, why in NOT_OFFERED.items():
        if name.lower().startswith(refused):
            raise ConfigError(f"--model {name}: not offered: {why}; choose one of {known}")
    raise ConfigError(f"--model {name}: no such captioner; choose one of {known}")


def captioner_dir(spec: CaptionerSpec) -> Path:
    """Where its files live: <model cache>/captioners/<name> ($FLUX_TRAIN_MODEL_CACHE, else <cache>/models)."""
    return model_cache(None) / "captioners" / spec.name


def setup_command(spec: CaptionerSpec) -> str:
    return f"flux-train setup --models --captioner {spec.name}"


def shard_names(index: Path) -> list[str]:
    """The weight files a safetensors index names."""
    return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))


def missing_files(spec: CaptionerSpec, folder: Path) -> list[str]:
    """What of `spec` is not (yet) in `folder`: its files, then the shards its index names. A file is only ever
    renamed into place complete, so present means whole."""
    missing = [f for f in spec.files if not (folder / f).is_file()]
    if (folder / INDEX).is_file():
        try:
            missing += [f for f in shard_names(folder / INDEX) if not (folder / f).is_file()]
        except (OSError, ValueError, KeyError):
            missing.append(f"{INDEX} (unreadable)")
    return missing
