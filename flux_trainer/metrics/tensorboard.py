"""TensorBoard: the run's texts and HParams written beside sd-scripts' scalars, and runs read back.

Writing goes through torch's ``SummaryWriter`` into the same directory sd-scripts' accelerate tracker writes
(``<logging_dir>/<prefix><timestamp>/network_train``): TensorBoard treats all event files of one directory as
one run, so config, command and GPU show up next to ``loss/*``. Reading uses TensorBoard's own
``EventAccumulator``, so what tests and ``flux-train runs`` see is what the dashboard sees.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_PREFIX = "run/"  # write_run_text({"config": ...}) -> tag "run/config"
_TEXT_SUFFIX = "/text_summary"  # what SummaryWriter.add_text appends to a tag
_FENCE_OPEN, _FENCE_CLOSE = "```text\n", "\n```"
_EVENT_MARK = "tfevents"
# sd-scripts' validation loss (dataset.validation_split): every validate_every_n_steps at the step
# (step_average), at each epoch's end at the epoch (epoch_average); *_divergence: it minus the training loss
VALIDATION_TAGS = "loss/validation/"
VALIDATION_LOSS_TAGS = (VALIDATION_TAGS + "step_average", VALIDATION_TAGS + "epoch_average")


def _writer(logdir: str | os.PathLike[str]) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.fspath(logdir))


def throttle_flush(writer: Any, every_s: float, clock: Any = None) -> bool:
    """Let `writer.flush()` (a SummaryWriter's) do its work at most every `every_s` seconds. accelerate's TensorBoard
    tracker flushes after every `log` call, and a flush waits until the writer thread has written every queued
    event: sd-scripts logs once a step, so each step waited for the file writes (H200 profile: ~1.6 ms a step, the
    device idle meanwhile). Events still reach the file on the writer thread, which flushes on its own every
    `flush_secs`; `close()` flushes everything whatever this does. False when it was throttled already."""
    import time

    flush = writer.flush
    if getattr(flush, "_flux_throttled", False):
        return False
    clock = clock or time.monotonic
    last = [clock()]

    def throttled() -> None:
        now = clock()
        if now - last[0] >= every_s:
            last[0] = now
            flush()

    throttled._flux_throttled = True
    writer.flush = throttled
    return True


def write_run_text(logdir: str | os.PathLike[str], texts: Mapping[str, str], step: int = 0) -> None:
    """Write texts (config YAML, launch command, environment profile, GPU name, kernels) as ``run/<key>``.

    Each text goes in a fenced code block, because TensorBoard renders text as markdown and would turn a YAML
    comment into a heading and join the command's lines; ``read_texts`` removes the fence again.
    """
    with _writer(logdir) as writer:
        for key, text in texts.items():
            writer.add_text(f"{TEXT_PREFIX}{key}", f"{_FENCE_OPEN}{text}{_FENCE_CLOSE}", global_step=step)


def write_images(logdir: str | os.PathLike[str], images: Mapping[str, os.PathLike[str] | str], step: int) -> None:
    """PNG files (sd-scripts' samples) as TensorBoard images, tag -> file, at ``step``."""
    import numpy as np
    from PIL import Image

    with _writer(logdir) as writer:
        for tag, path in images.items():
            with Image.open(path) as im:
                writer.add_image(tag, np.asarray(im.convert("RGB")), global_step=step, dataformats="HWC")


def write_new_samples(logdir: str | os.PathLike[str], sample_dir: Path, logged: set[str], step: int) -> list[str]:
    """The PNG files in `sample_dir` not in `logged` (names), as TensorBoard images `samples/<n>` at `step`: the
    samples a trainer just rendered (sd-scripts and musubi-tuner both write them into <output_dir>/sample). `logged`
    gains their names; returns them."""
    if not sample_dir.is_dir():
        return []
    new = sorted(p for p in sample_dir.glob("*.png") if p.name not in logged)
    if not new:
        return []
    write_images(logdir, {f"samples/{i:02d}": path for i, path in enumerate(new)}, step)
    logged.update(p.name for p in new)
    return [p.name for p in new]


def read_images(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, int, int]]]:
    """tag -> [(step, width, height)] of the images in ``logdir``."""
    acc = _accumulator(logdir)
    return {tag: [(e.step, e.width, e.height) for e in acc.Images(tag)] for tag in acc.Tags().get("images", [])}


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | str]:
    """Nested mapping -> ``{"network.rank": 16, ...}`` with values the HParams dashboard can compare.

    Numbers stay numbers (so runs sort by them); bools and None become the strings ``True``/``False``/``None``
    (torch would store a bool as 1.0 and drop None); lists and other values become their ``repr``.
    Pass an OmegaConf config through ``OmegaConf.to_container(cfg, resolve=True)`` first.
    """
    out: dict[str, float | int | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_config(value, f"{name}."))
        elif isinstance(value, bool) or value is None:
            out[name] = str(value)
        elif isinstance(value, (int, float, str)):
            out[name] = value
        else:
            out[name] = repr(value)
    return out


def write_hparams(
    logdir: str | os.PathLike[str], hparams: Mapping[str, Any], metrics: Mapping[str, float | None], step: int = 0
) -> None:
    """Record the run's (nested) config as HParams, in ``logdir`` itself, so the HParams dashboard compares runs.

    ``metrics`` names the scalar tags the dashboard shows per run (e.g. ``loss/average``, ``time/step_s``).
    A None value means the training logs that tag itself; a number is written as a scalar at ``step``.
    Why not ``SummaryWriter.add_hparams``: it writes into a new timestamped subdirectory, i.e. a second run
    that has the HParams but none of the training's scalars.
    """
    from torch.utils.tensorboard.summary import hparams as hparams_summary

    flat = flatten_config(hparams)
    exp, ssi, sei = hparams_summary(flat, {tag: 0.0 for tag in metrics})
    with _writer(logdir) as writer:
        for summary in (exp, ssi, sei):
            writer.file_writer.add_summary(summary, step)
        for tag, value in metrics.items():
            if value is not None:
                writer.add_scalar(tag, value, step)


def _accumulator(logdir: str | os.PathLike[str]) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tb_logging

    # its reader logs each event file it moves on to at INFO: under Hydra's logging (a sweep's summary) that was a
    # line per file on the terminal
    tb_logging.get_logger().setLevel(max(tb_logging.get_logger().level, logging.WARNING))
    acc = EventAccumulator(os.fspath(logdir), size_guidance={"scalars": 0, "tensors": 0})  # 0 = load everything
    acc.Reload()
    return acc


def _scalar_events(acc: Any) -> dict[str, list[tuple[float, int, float]]]:
    """(wall_time, step, value) per tag, from classic scalars and from scalar-plugin tensors (TF2 writers)."""
    out = {tag: [(e.wall_time, e.step, float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    from tensorboard.util import tensor_util

    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":
            out[tag] = [
                (e.wall_time, e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)
            ]
    return out


def read_scalars(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """All scalars of one run directory (or one event file): ``{tag: [(step, value), ...]}`` in written order."""
    return {tag: [(s, v) for _, s, v in events] for tag, events in _scalar_events(_accumulator(logdir)).items()}


def read_texts(logdir: str | os.PathLike[str]) -> dict[str, str]:
    """Texts of one run directory: ``{"run/config": "...", ...}``, the latest step's text per tag, unfenced."""
    acc = _accumulator(logdir)
    out: dict[str, str] = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "text":
            continue
        events = acc.Tensors(tag)
        if not events:
            continue
        text = b"".join(events[-1].tensor_proto.string_val).decode("utf-8")
        if text.startswith(_FENCE_OPEN) and text.endswith(_FENCE_CLOSE):
            text = text[len(_FENCE_OPEN) : -len(_FENCE_CLOSE)]
        out[tag.removesuffix(_TEXT_SUFFIX)] = text
    return out


def read_hparams(logdir: str | os.PathLike[str]) -> dict[str, float | str | bool]:
    """The HParams recorded in a run directory (as ``write_hparams`` flattened them)."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = _accumulator(logdir)
    try:
        content = acc.PluginTagToContent("hparams")
    except KeyError:  # no HParams in this run
        content = {}
    out: dict[str, float | str | bool] = {}
    for raw in content.values():
        data = plugin_data_pb2.HParamsPluginData.FromString(raw)
        if data.HasField("session_start_info"):
            for name, value in data.session_start_info.hparams.items():
                kind = value.WhichOneof("kind")
                out[name] = getattr(value, kind) if kind else ""
    return out


@dataclass(frozen=True)
class RunSummary:
    """One line of ``flux-train runs``. Times are Unix seconds; None where the run has no such data yet."""

    path: str
    steps_done: int
    last_loss: float | None
    loss_tag: str | None
    median_step_s: float | None
    peak_vram_gib: float | None
    median_tflops: float | None
    gpu: str | None
    started: float | None
    updated: float | None
    startup_s: float | None = None  # command to the first step's end (the latest process's, for a resumed run)
    # the card's power draw and SM clock over the steps (medians of gpu/power_w, gpu/sm_clock_mhz): a card at its
    # power limit runs below its boost clock, which explains two runs of one setting on two cards
    median_power_w: float | None = None
    median_sm_clock_mhz: float | None = None
    last_val_loss: float | None = None  # the newest validation loss (by wall time), step's or epoch's


def _event_dirs(root: str | os.PathLike[str]) -> list[str]:
    """Directories under root (root included) that hold event files, i.e. TensorBoard runs."""
    found = []
    for dirpath, dirnames, filenames in os.walk(os.fspath(root)):
        dirnames.sort()
        if any(_EVENT_MARK in name for name in filenames):
            found.append(dirpath)
    return found


def _loss_tag(tags: Iterable[str]) -> str | None:
    """sd-scripts logs ``loss/current`` (this step) and ``loss/average`` (moving); prefer the former."""
    losses = sorted(t for t in tags if t.startswith("loss/") and not t.startswith(VALIDATION_TAGS))
    return "loss/current" if "loss/current" in losses else (losses[0] if losses else None)


def _summarize(path: str, dirs: list[str]) -> RunSummary:
    scalars: dict[str, list[tuple[float, int, float]]] = {}
    texts: dict[str, str] = {}
    for d in dirs:
        acc = _accumulator(d)
        for tag, events in _scalar_events(acc).items():
            scalars.setdefault(tag, []).extend(events)
        texts.update(read_texts(d))
    for events in scalars.values():
        events.sort(key=lambda e: (e[1], e[0]))

    loss_tag = _loss_tag(scalars)
    counted = scalars[loss_tag] if loss_tag else [e for events in scalars.values() for e in events]
    walls = [e[0] for events in scalars.values() for e in events]

    def median(tag: str) -> float | None:
        values = [e[2] for e in scalars.get(tag, [])]
        return statistics.median(values) if values else None

    peaks = [e[2] for e in scalars.get("vram/peak_gib", [])]
    validations = [e for tag in VALIDATION_LOSS_TAGS for e in scalars.get(tag, [])]
    return RunSummary(
        path=path,
        steps_done=max((e[1] for e in counted), default=0),
        last_loss=scalars[loss_tag][-1][2] if loss_tag else None,
        loss_tag=loss_tag,
        median_step_s=median("time/step_s"),
        peak_vram_gib=max(peaks) if peaks else None,
        median_tflops=median("throughput/tflops"),
        gpu=texts.get(f"{TEXT_PREFIX}gpu"),
        started=min(walls) if walls else None,
        updated=max(walls) if walls else None,
        startup_s=max(scalars["time/startup_s"], key=lambda e: e[0])[2] if scalars.get("time/startup_s") else None,
        median_power_w=median("gpu/power_w"),
        median_sm_clock_mhz=median("gpu/sm_clock_mhz"),
        last_val_loss=max(validations, key=lambda e: e[0])[2] if validations else None,
    )


def summarize_run(run_dir: str | os.PathLike[str]) -> RunSummary:
    """Summarise a run from its event files anywhere under ``run_dir`` (a flux-train run dir keeps sd-scripts'
    events a few levels down; a resumed run adds a second event directory, merged here by step)."""
    dirs = _event_dirs(run_dir)
    if not dirs:
        raise FileNotFoundError(f"no TensorBoard event files under {os.fspath(run_dir)}")
    return _summarize(os.fspath(run_dir), dirs)


def list_runs(root: str | os.PathLike[str]) -> list[RunSummary]:
    """Every TensorBoard run (directory with event files) under ``root``, oldest first."""
    runs = [_summarize(d, [d]) for d in _event_dirs(root)]
    return sorted(runs, key=lambda r: (r.started is None, r.started or 0.0, r.path))
