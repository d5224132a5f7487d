"""flux-train: FLUX.1 LoRA training on kohya-ss sd-scripts, configured by Hydra, watched in TensorBoard."""

__version__ = "0.1.0"
