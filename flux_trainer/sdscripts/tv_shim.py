"""The few `torchvision.transforms` that sd-scripts' FLUX path uses, in plain PyTorch (see
`checkout.install_torchvision_shim`). Semantics follow torchvision's documented behaviour."""

from __future__ import annotations

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


def transforms_module() -> types.ModuleType:
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    fn.pil_to_tensor = pil_to_tensor
    fn.gaussian_blur = gaussian_blur
    tr.Compose, tr.ToTensor, tr.Normalize, tr.functional = Compose, ToTensor, Normalize, fn
    return tr
