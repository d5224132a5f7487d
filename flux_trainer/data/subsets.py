"""A dataset's folders and resolutions, whichever form its YAML takes.

A dataset is one folder (`images:`) or a list of them (`subsets:`), at one resolution or several. Everything
downstream (the checks, the staging, the dataset TOML) reads the two lists below, so the single-folder form is
simply a list of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Subset:
    """One folder as it trains: the dataset's values filled in where the subset left them null."""

    images: str
    trigger: str | None
    repeats: int
    caption_dropout_rate: float
    is_reg: bool = False
    alpha_mask: bool = False  # the images' own alpha, or (with masks) the alpha flux-train makes from the masks
    masks: str | None = None


def subsets_of(d: Any) -> list[Subset]:
    """The dataset's folders in the order written. The single-folder form is one subset of the dataset's keys."""
    listed = d.get("subsets") or []
    if not listed:
        rate = float(d.get("caption_dropout_rate") or 0.0)
        masks = d.get("masks")
        alpha = bool(d.get("alpha_mask") or masks)
        return [Subset(str(d.images), d.trigger, int(d.repeats), rate, alpha_mask=alpha, masks=masks)]
    out = []
    for s in listed:
        is_reg = bool(s.get("is_reg", False))
        trigger = s.get("trigger")
        if trigger is None and not is_reg:  # reg images are the class: they never inherit the trigger word
            trigger = d.trigger
        repeats = s.get("repeats")
        rate = s.get("caption_dropout_rate")
        alpha = d.get("alpha_mask") if s.get("alpha_mask") is None else s.alpha_mask
        out.append(
            Subset(
                images=str(s.images),
                trigger=trigger,
                repeats=int(d.repeats if repeats is None else repeats),
                caption_dropout_rate=float(d.get("caption_dropout_rate") or 0.0 if rate is None else rate),
                is_reg=is_reg,
                alpha_mask=bool(s.get("masks") or alpha),
                masks=s.get("masks"),
            )
        )
    return out


def resolutions_of(d: Any) -> list[Any]:
    """`resolution` as a list (its values unchecked: config.validate refuses what is not a whole number)."""
    res = d.resolution
    if isinstance(res, (int, float, str)) or res is None:
        return [res]
    return list(res)


def largest_resolution(d: Any) -> int:
    """The resolution of the largest buckets: what memory and FLOPs estimates plan for."""
    return max(int(r) for r in resolutions_of(d))
