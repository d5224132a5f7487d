"""The few `torchvision.transforms` that sd-scripts' FLUX path uses, in plain PyTorch (see
`install_torchvision_shim`). Semantics follow torchvision's documented behaviour. musubi-tuner imports torchvision
at the top of modules its FLUX.2 / Kontext path loads, and uses it only to tile sample images (`utils.make_grid`),
which the shim has too."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import numpy as np
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


def pil_to_tensor(image) -> torch.Tensor:
    """HWC uint8 image -> CHW uint8 tensor, values unchanged."""
    arr = np.array(image, copy=True)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class ToTensor:
    """PIL image or HWC uint8 ndarray -> CHW float tensor in [0, 1]."""

    def __call__(self, pic) -> torch.Tensor:
        t = pil_to_tensor(pic)
        return t.float().div(255) if t.dtype == torch.uint8 else t.float()


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = list(mean), list(std)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=t.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=t.dtype).view(-1, 1, 1)
        return (t - mean) / std


def gaussian_blur(*_args, **_kwargs):
    raise NotImplementedError("gaussian_blur needs a real torchvision: install the build matching your torch")


def make_grid(tensor: torch.Tensor, nrow: int = 8, padding: int = 2, pad_value: float = 0.0) -> torch.Tensor:
    """Images [B, C, H, W] (or one [C, H, W]) tiled into one [3 or C, rows, cols] image, `nrow` to a row, each with
    `padding` pixels of `pad_value` around it; a single image comes back as it is; one channel becomes three (as
    torchvision's documented `make_grid`)."""
    if tensor.dim() == 3:
        tensor = tensor.unsqueeze(0)
    if tensor.size(1) == 1:
        tensor = tensor.expand(-1, 3, -1, -1)
    if tensor.size(0) == 1:
        return tensor[0]
    count, channels, height, width = tensor.shape
    cols = min(nrow, count)
    rows = -(-count // cols)
    cell_h, cell_w = height + padding, width + padding
    grid = tensor.new_full((channels, rows * cell_h + padding, cols * cell_w + padding), pad_value)
    for i in range(count):
        top, left = (i // cols) * cell_h + padding, (i % cols) * cell_w + padding
        grid[:, top : top + height, left : left + width] = tensor[i]
    return grid


def transforms_module() -> types.ModuleType:
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    fn.pil_to_tensor = pil_to_tensor
    fn.gaussian_blur = gaussian_blur
    tr.Compose, tr.ToTensor, tr.Normalize, tr.functional = Compose, ToTensor, Normalize, fn
    return tr


def install_torchvision_shim() -> bool:
    """sd-scripts imports `torchvision.transforms` for ToTensor/Normalize only. Where torchvision cannot be
    installed (CPU-only PyTorch builds without a matching torchvision), give it those few transforms in
    plain PyTorch. Does nothing when a real torchvision imports. Returns True if the shim was installed."""
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:  # noqa: BLE001 - a broken torchvision (wrong CUDA build) is as absent as a missing one
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    tv = types.ModuleType("torchvision")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    tv.__version__ = "0.0.0+flux-train-shim"
    tv.transforms = transforms_module()
    tv.utils = types.ModuleType("torchvision.utils")  # make_grid alone: the rest is absent, so a use fails by name
    tv.utils.make_grid = make_grid
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.utils"] = tv.utils
    sys.modules["torchvision.transforms"] = tv.transforms
    sys.modules["torchvision.transforms.functional"] = tv.transforms.functional
    logging.getLogger(__name__).info(
        "torchvision is not importable: using flux-train's minimal torchvision.transforms for the trainer"
    )
    return True
