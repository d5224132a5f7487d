"""Text-encoder outputs already on disk: nothing to encode, so no model to move.

sd-scripts' `FluxNetworkTrainer.cache_text_encoder_outputs_if_needed` moves the VAE and the FLUX model to the CPU and
the text encoders (T5-XXL: 9.5 GB in bf16) to the GPU, asks the dataset to cache what is missing, then moves them all
back, whether anything was missing or not. In a warm `vram80` run on the H200 (2026-11-25) the log spent ~7 s
between those lines, with every output on disk. The runner asks first, with sd-scripts' own caching strategy
(`all_on_disk`); when every image's outputs are on disk and no sample prompt needs encoding, the dataset still runs
its own check (which records each image's file, what training reads) with the models left where they are. So each
file is checked twice (here, then by the dataset): small reads against the model moves they save.
"""

from __future__ import annotations

from typing import Any


def all_on_disk(args: Any, dataset: Any, strategy: Any) -> bool:
    """Whether sd-scripts' text-encoder caching would encode nothing: outputs cached to disk, every image of every
    dataset of the group with its file there (as sd-scripts' strategy judges it), no sample prompts (sd-scripts
    encodes those in the same place)."""
    cached = ("cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk")
    if not all(getattr(args, name, False) for name in cached):
        return False
    if getattr(args, "sample_prompts", None) or dataset is None or strategy is None or not strategy.cache_to_disk:
        return False
    return all(
        strategy.is_disk_cached_outputs_expected(strategy.get_outputs_npz_path(info.absolute_path))
        for member in dataset.datasets
        for info in member.image_data.values()
    )
