"""Doctor check of the disk that sd-scripts' caches go to: free space against an estimate for the dataset.

sd-scripts writes its disk caches beside each image (`library/strategy_flux.py`): `<stem>_<W>x<H>_flux.npz`
(latents) and `<stem>_flux_te.npz` (text-encoder outputs), uncompressed `np.savez`. Both are stored as float32
whatever the training dtype, because sd-scripts calls `.float()` before `.numpy()`:

* latents: 16 channels x H/8 x W/8 x 4 bytes (twice with flip_aug) = 1 MiB at 1024^2;
* text: T5 tokens x 4096 x 4 bytes + CLIP-L pooled 768 x 4 + txt_ids tokens x 3 x 4 + the int64 attention mask
  = 8 MiB at 512 tokens.

So ~9 MiB per image at 1024^2 (dev). Images that already have their cache files need nothing new.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from flux_trainer.data.check import IMAGE_EXTENSIONS
from flux_trainer.data.subsets import resolutions_of
from flux_trainer.doctor.core import FAIL, PASS, SKIP, WARN, CheckResult, gib, one_line

GROUP = "disk"
LATENT_CHANNELS, T5_DIM, CLIP_POOLED = 16, 4096, 768
NPZ_OVERHEAD = 2048  # zip directory, array headers, original_size / crop_ltrb arrays
HEADROOM = 2 * 2**30  # warn when less than this would be left after caching
_LATENT_FILE = re.compile(r"^(.*)_\d+x\d+_flux\.npz$")
_TE_SUFFIX = "_flux_te.npz"


def latent_bytes(resolution: int, flip: bool = False) -> int:
    side = resolution // 8
    return LATENT_CHANNELS * side * side * 4 * (2 if flip else 1) + NPZ_OVERHEAD


def text_bytes(t5_tokens: int) -> int:
    return t5_tokens * T5_DIM * 4 + CLIP_POOLED * 4 + t5_tokens * 3 * 4 + t5_tokens * 8 + NPZ_OVERHEAD


def t5_tokens_for(cfg) -> int:
    """model.t5xxl_max_token_length, else sd-scripts' default: 256 for schnell, 512 for dev."""
    configured = cfg.model.get("t5xxl_max_token_length")
    if configured:
        return int(configured)
    return 256 if str(cfg.model.name) == "flux_schnell" else 512


def disk_check(cfg) -> CheckResult:
    """Free space where the latents and text-encoder outputs will be cached (the dataset folder) vs the estimate."""
    if OmegaConf.is_missing(cfg, "dataset"):
        return CheckResult("disk", SKIP, "no +dataset=NAME given: no cache to estimate", "", GROUP)
    d, cache = cfg.dataset, cfg.cache
    if d.get("subsets"):
        return CheckResult("disk", SKIP, f"dataset '{d.name}' lists several folders: not estimated yet", "", GROUP)
    folder = Path(str(d.images)).expanduser()
    if not folder.is_dir():
        return CheckResult("disk", SKIP, f"{folder} does not exist (see the config row)", "", GROUP)
    latents = bool(cache.latents and cache.latents_to_disk)
    text = bool(cache.text_encoder_outputs and cache.text_encoder_outputs_to_disk)
    if not (latents or text):
        return CheckResult(
            "disk", PASS, "caches are kept in memory (cache.*_to_disk=false): nothing written", "", GROUP
        )
    try:
        names = os.listdir(folder)
        free = shutil.disk_usage(folder).free
    except OSError as e:
        return CheckResult("disk", FAIL, f"{folder}: {one_line(e)}", "check the dataset folder's permissions", GROUP)
    images = [os.path.splitext(n)[0] for n in names if os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS]
    have_latents = {m.group(1) for n in names if (m := _LATENT_FILE.match(n))}
    have_text = {n.removesuffix(_TE_SUFFIX) for n in names if n.endswith(_TE_SUFFIX)}
    tokens = t5_tokens_for(cfg)
    per_latent, per_text = sum(latent_bytes(int(r), bool(d.flip_aug)) for r in resolutions_of(d)), text_bytes(tokens)
    new_latents = sum(1 for s in images if s not in have_latents) if latents else 0
    new_text = sum(1 for s in images if s not in have_text) if text else 0
    need = new_latents * per_latent + new_text * per_text
    data = {
        "folder": str(folder),
        "images": len(images),
        "need_bytes": need,
        "free_bytes": free,
        "per_image_bytes": (per_latent if latents else 0) + (per_text if text else 0),
        "already_cached": {"latents": len(have_latents), "text": len(have_text)},
    }
    what = " + ".join(
        p
        for p, on in (
            (f"latents {per_latent / 2**20:.1f} MiB", latents),
            (f"T5/CLIP {per_text / 2**20:.1f} MiB ({tokens} tokens)", text),
        )
        if on
    )
    evidence = (
        f"{len(images)} images x ({what}) at {d.resolution}px; to write {gib(need)}, free {gib(free)} on {folder}"
    )
    if need and not os.access(folder, os.W_OK):
        return CheckResult(
            "disk",
            FAIL,
            f"{evidence}: the folder is not writable and sd-scripts caches beside the images",
            "make it writable, or copy the dataset to a writable disk",
            GROUP,
            data,
        )
    in_ram = "or keep them in RAM: cache.latents_to_disk=false cache.text_encoder_outputs_to_disk=false"
    if free < need:
        return CheckResult("disk", FAIL, evidence, f"free {gib(need - free)} on that disk, {in_ram}", GROUP, data)
    if free - need < HEADROOM:
        return CheckResult(
            "disk", WARN, f"{evidence}: under {gib(HEADROOM)} would be left", f"free space, {in_ram}", GROUP, data
        )
    return CheckResult("disk", PASS, evidence, "", GROUP, data)
