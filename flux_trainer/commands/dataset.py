"""`flux-train dataset init`: look at an image folder, report what is there, write the dataset config."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from flux_trainer.config import ConfigError
from flux_trainer.data.check import IMAGE_EXTENSIONS, caption_of


@dataclass
class FolderReport:
    folder: Path
    by_format: dict[str, int]
    captioned: int
    uncaptioned: list[str]
    sizes: Counter = field(default_factory=Counter)  # (w, h) -> count, as shown (EXIF rotation applied)
    unreadable: list[str] = field(default_factory=list)  # names of files that cannot be trained on
    problems: list[str] = field(default_factory=list)  # one line per such file, saying why
    notes: list[str] = field(default_factory=list)  # what is done for the user (rotated photos, recoded captions)

    @property
    def total(self) -> int:
        return sum(self.by_format.values())

    def text(self) -> str:
        formats = ", ".join(f"{n} {ext[1:]}" for ext, n in sorted(self.by_format.items())) or "none"
        lines = [
            f"{self.folder}: {self.total} images ({formats})",
            f"  captions: {self.captioned} found, {len(self.uncaptioned)} missing",
        ]
        if self.sizes:
            smallest = min(self.sizes, key=lambda s: s[0] * s[1])
            largest = max(self.sizes, key=lambda s: s[0] * s[1])
            common = ", ".join(f"{w}x{h} ({n})" for (w, h), n in self.sizes.most_common(3))
            lines.append(
                f"  sizes: smallest {smallest[0]}x{smallest[1]}, largest {largest[0]}x{largest[1]}; "
                f"most common {common}"
            )
        if self.unreadable:
            lines.append(f"  cannot be trained on: {len(self.unreadable)} ({', '.join(self.unreadable[:5])})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def describe_folder(folder: Path) -> FolderReport:
    """Counts by format, captions found and missing, image sizes, and every file that cannot be trained on (the
    same check a launch makes: flux_trainer.data.check)."""
    from flux_trainer.config.paths import cache_root
    from flux_trainer.data.check import check_folder

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--images {folder}: no such folder")
    check = check_folder(folder, ".txt", cache_root())
    by_format: Counter = Counter(Path(n).suffix.lower() for n in check.images)
    usable = check.usable()
    captioned = [n for n in usable if caption_of(check, n, ".txt")]
    report = FolderReport(check.folder, dict(by_format), len(captioned), [n for n in usable if n not in captioned])
    for name in usable:
        r = check.images[name]
        report.sizes[(r.width, r.height)] += 1
    report.unreadable = sorted({*(n for n, r in check.images.items() if r.problem), *check.broken_links})
    report.problems = check.problems()
    report.notes = check.notes()
    return report


def config_problems(
    report: FolderReport,
    name: str,
    path: Path,
    *,
    trigger: str | None,
    resolution: int | list[int],
    force: bool,
    captions_to_come: bool = False,
) -> list[str]:
    """Every reason not to write the config, at once. `captions_to_come`: `--caption` will caption the images that
    have none, so missing captions are not one (yet)."""
    problems = []
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        problems.append(f"dataset name {name!r}: use letters, digits, '_' and '-'")
    if report.total == 0:
        problems.append(f"--images {report.folder}: no images ({' '.join(IMAGE_EXTENSIONS)})")
    if report.problems:
        problems += report.problems[:20]
        more = f" ({len(report.problems) - 20} more not listed)" if len(report.problems) > 20 else ""
        problems.append(f"--images {report.folder}: fix or remove the {len(report.problems)} file(s) above{more}")
    if report.uncaptioned and not trigger and not captions_to_come:
        problems.append(
            f"{len(report.uncaptioned)} images have no .txt caption; add captions, pass --caption to write them, "
            "or pass --trigger WORD"
        )
    problems += resolution_problems(resolution if isinstance(resolution, list) else [resolution])
    if path.exists() and not force:
        problems.append(f"{path} exists; pass --force to overwrite it")
    return problems


def resolution_problems(resolutions: list[int]) -> list[str]:
    from flux_trainer.config.validate import RESOLUTION_RANGE

    lo, hi = RESOLUTION_RANGE
    return [
        f"--resolution {r}: must be a multiple of 16 between {lo} and {hi}"
        for r in resolutions
        if r % 16 or not lo <= r <= hi
    ]


def parse_resolutions(text: str) -> list[int]:
    """`--resolution 512,768,1024` as numbers; ConfigError for anything else."""
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"--resolution {text}: a number of pixels, or several: 512,768,1024") from None
    if len(set(values)) != len(values):
        raise ConfigError(f"--resolution {text}: a resolution is listed twice; list each once")
    return values


def write_dataset_config(
    config_dir: Path,
    name: str,
    images: Path,
    *,
    trigger: str | None = None,
    resolution: int | list[int] = 1024,
    repeats: int = 10,
    force: bool = False,
    report: FolderReport | None = None,
    extra: dict | None = None,
) -> Path:
    """Write <config_dir>/dataset/<name>.yaml. Refuses an empty or missing folder, unreadable images,
    uncaptioned images without a trigger word, and an existing config unless force."""
    report = report or describe_folder(images)
    path = Path(config_dir) / "dataset" / f"{name}.yaml"
    problems = config_problems(report, name, path, trigger=trigger, resolution=resolution, force=force)
    if problems:
        raise ConfigError(problems)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = [
        f"# flux-train +dataset={name}",
        f"# {report.total} images, {report.captioned} with captions (written by `flux-train dataset init`).",
        f"name: {json.dumps(name)}",
        f"images: {json.dumps(str(report.folder))}",
        f"trigger: {json.dumps(trigger) if trigger else 'null'}  # starts every caption",
        f"resolution: {json.dumps(resolution)}  # training resolution; images are bucketed by aspect ratio around it",
        f"repeats: {repeats}  # times each image is seen per epoch",
    ]
    body += [f"{k}: {json.dumps(v)}" for k, v in (extra or {}).items()]
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("\n".join(body) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def dataset_init(ns: argparse.Namespace) -> int:
    from flux_trainer.config.paths import CONFIG_DIR_ENV

    config_dir = ns.config_dir or (
        Path(os.environ[CONFIG_DIR_ENV]) if os.environ.get(CONFIG_DIR_ENV) else Path("configs")
    )
    resolutions = parse_resolutions(ns.resolution)
    resolution = resolutions[0] if len(resolutions) == 1 else resolutions
    masks = mask_folders(ns)
    if len(ns.images) > 1 or ns.reg:
        path = init_subsets(ns, config_dir, resolution, masks)
        print(f"wrote {path}\nnext: flux-train +dataset={ns.name} dry_run=true")
        return 0
    ns.images = ns.images[0]
    report = describe_folder(ns.images)
    print(report.text())
    if ns.caption:
        report = caption_for_init(ns, config_dir, report, resolution)
    path = write_dataset_config(
        config_dir,
        ns.name,
        ns.images,
        trigger=ns.trigger,
        resolution=resolution,
        repeats=ns.repeats,
        force=ns.force,
        report=report,
        extra={"masks": masks[0]} if masks else None,
    )
    print(f"wrote {path}\nnext: flux-train +dataset={ns.name} dry_run=true")
    return 0


def mask_folders(ns: argparse.Namespace) -> list[str]:
    """`--masks` folders, the Nth for the Nth `--images`, each matched to its images (data.masks) as a launch will:
    every problem in one refusal, before anything is written; the notes printed."""
    from flux_trainer.data.check import check_folder
    from flux_trainer.data.masks import match_masks

    if not ns.masks:
        return []
    if len(ns.masks) > len(ns.images):
        raise ConfigError(f"{len(ns.masks)} --masks for {len(ns.images)} --images: give one per --images, in order")
    problems = []
    for images, masks in zip(ns.images, ns.masks, strict=False):
        if not Path(images).expanduser().is_dir():
            continue  # describe_folder names it
        matched = match_masks(check_folder(Path(images).expanduser()), Path(masks).expanduser(), "--masks")
        problems += matched.problems
        for note in matched.notes:
            print(note)
    if problems:
        raise ConfigError(problems)
    return [str(Path(m).expanduser().resolve()) for m in ns.masks]


def init_subsets(
    ns: argparse.Namespace, config_dir: Path, resolution: int | list[int], masks: list[str] | None = None
) -> Path:
    """`dataset init` with several `--images` or a `--reg`: every folder described and checked, then one config
    listing them as subsets. Reg folders take no trigger word: their images need captions of their own."""
    if ns.caption:
        raise ConfigError("--caption captions one folder: run `flux-train dataset caption DIR` for each, then init")
    folders = [(Path(f), False) for f in ns.images] + [(Path(f), True) for f in ns.reg]
    path = Path(config_dir) / "dataset" / f"{ns.name}.yaml"
    problems: list[str] = []
    reports = []
    for folder, is_reg in folders:
        flag = "--reg" if is_reg else "--images"
        try:
            report = describe_folder(folder)
        except ConfigError as exc:
            raise ConfigError([p.replace("--images", flag) for p in exc.problems]) from None
        print(report.text())
        reports.append(report)
        for p in config_problems(
            report, ns.name, path, trigger=None if is_reg else ns.trigger, resolution=resolution, force=ns.force
        ):
            if "have no .txt caption" in p:
                fix = (
                    "caption them (a reg folder takes no trigger word)" if is_reg else "caption them or pass --trigger"
                )
                p = f"{flag} {report.folder}: {len(report.uncaptioned)} images have no .txt caption; {fix}"
            problems += [p.replace("--images", flag)] if p not in problems else []
    if len({str(r.folder) for r in reports}) != len(reports):
        problems.append("a folder is given twice; give each once (--repeats weights all of them)")
    if problems:
        raise ConfigError(problems)
    subsets = []
    for (_, is_reg), report in zip(folders, reports, strict=True):
        entry = {"images": str(report.folder), "repeats": 1 if is_reg else ns.repeats}
        if is_reg:
            entry["is_reg"] = True
        elif ns.trigger:
            entry["trigger"] = ns.trigger
        if not is_reg and len(subsets) < len(masks or []):
            entry["masks"] = (masks or [])[len(subsets)]
        subsets.append(entry)
    body = [
        f"# flux-train +dataset={ns.name}",
        f"# {len(folders)} folders, {sum(r.total for r in reports)} images (written by `flux-train dataset init`).",
        f"name: {json.dumps(ns.name)}",
        f"resolution: {json.dumps(resolution)}  # one sd-scripts dataset per resolution, over every folder",
        "subsets:",
    ]
    for entry in subsets:
        body.append("  - " + "\n    ".join(f"{k}: {json.dumps(v)}" for k, v in entry.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("\n".join(body) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def caption_for_init(
    ns: argparse.Namespace, config_dir: Path, report: FolderReport, resolution: int | list[int] = 1024
) -> FolderReport:
    """`dataset init --caption`: refuse what would refuse the config first (no minutes of captioning before "the
    name is invalid"), then caption the images without one. The trigger word is not written into the captions: the
    config's `trigger` puts it in front of every caption at training, and written too it would come twice."""
    from flux_trainer.commands.caption import caption_images, prepare

    path = Path(config_dir) / "dataset" / f"{ns.name}.yaml"
    problems = config_problems(
        report, ns.name, path, trigger=ns.trigger, resolution=resolution, force=ns.force, captions_to_come=True
    )
    if problems:
        raise ConfigError(problems)
    spec, plan, files = prepare(ns.images, ns.caption, overwrite=False)
    outcome = caption_images(spec, plan, files)
    print("captions: " + outcome.summary())
    if outcome.interrupted:
        raise KeyboardInterrupt
    return describe_folder(ns.images)
