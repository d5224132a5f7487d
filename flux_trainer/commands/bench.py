"""`flux-train bench`: real training steps on a random full-size model, through the same launcher and runner as
training, for several presets / kernel sets / resolutions; a table and JSON. FLUX.1 (and Chroma) train on sd-scripts;
FLUX.2 [klein] and Kontext (`--model random_flux2_klein_4b`, `random_flux2_klein_9b`, `random_kontext`) on
musubi-tuner, and `--baseline` runs plain musubi-tuner beside them (flux_trainer.musubi.baseline).

    flux-train bench --cases memory=vram80 memory=vram48 --kernels off auto --steps 20 --baseline
    flux-train bench --cases memory=vram24 --vram-cap 24      # prove a 24 GB card's preset on a bigger card
    flux-train bench --cases memory=vram48 --kernels off fp8+kernels.cuda_graphs=true   # one set's own overrides
    flux-train bench --kernels fp8 "fp8+kernels.set='auto,fp8_matmul,-single_qkv'" --abba   # A B B A
    flux-train bench --tiers                  # every memory tier at its card's size, plain sd-scripts beside each
                                              # (one kernel set: its numerics against the plain trainer's run)
    flux-train bench --tiers vram8 vram12 --kernels off auto --steps 25   # with numerics against kernels=off
    flux-train bench --table a.json b.json    # the tier table of benches run apart (one machine per tier group)
    flux-train bench --model random_flux2_klein_4b --tiers   # klein 4B's tiers (8, 12, 16), plain musubi-tuner beside

Step time is measured the same way for flux-train and for the plain trainer (`--baseline`): the wall time
between successive `loss/current` TensorBoard events, which sd-scripts and musubi-tuner alike write once per
optimizer step after `loss.item()` has waited for the device (for the whole step; with flux-train's
`train.sync_free`, the default, for that step's forward: either way once a step, so the events are a step apart).
Peak memory: torch's peak allocated (our `vram/peak_gib` tag) and the peak NVML reading of the whole card, polled
while the run lasts (the plain trainer has only the latter).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flux_trainer.backend import SDSCRIPTS
from flux_trainer.commands.bench_models import (
    PLAIN_SUFFIXES,
    bench_model,
    default_tiers,
    plain_base,
    plain_trainer,
    tier_target,
)
from flux_trainer.config.paths import cache_root
from flux_trainer.sdscripts.runner import VRAM_CAP_ENV


@dataclass
class BenchResult:
    case: str
    overrides: list[str]
    exit_code: int
    steps: int = 0
    s_per_step: float | None = None
    s_min: float | None = None
    s_max: float | None = None
    # the measured window's wall time over its steps: throughput, which intervals bunched by the loop's asynchronous
    # logging (train.sync_free: a step's events can land late, the next one's early) do not move
    s_mean: float | None = None
    torch_peak_gib: float | None = None
    # the allocator's reserve at its peak (vram/reserved_peak_gib): between the two above, it says how much of the
    # card's excess over torch's peak is the allocator's (fragmentation, CUDA graphs' pools) and how much is not
    reserved_peak_gib: float | None = None
    card_peak_gib: float | None = None
    # the whole card's power draw and SM clock (NVML), medians over the measured steps: a card at its power limit
    # runs below its boost clock, and two cards of one kind can differ there (compare s/step within one command)
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    # the card's energy a step (NVML's energy counter over the measured steps, times their mean wall time): where the
    # card sits at its power limit, a step gets faster only by taking fewer joules, not only fewer seconds
    energy_j: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    # images a second over every process (throughput/images_per_s_all_ranks; one process: throughput/images_per_s)
    images_per_s: float | None = None
    first_step_s: float | None = None
    step1_extra_s: float | None = None  # the first step's compute (data wait excluded) minus the median step
    step2_extra_s: float | None = None  # the same for the second (a retrace there: selective checkpointing's plan)
    compared_to: str | None = None  # numerics against this case (same settings, the first --kernels set)
    loss_rel_diff: float | None = None  # mean over steps of |loss - loss_ref| / |loss_ref|
    # the same without the absolute value: near 0 where the runs differ by noise, near -loss_rel_diff where this run's
    # loss is the lower one at every step (a drift, as torch.compile's late-step loss gap against eager bf16)
    loss_rel_bias: float | None = None
    # the run's TOML stores the frozen base in fp8 (the numerics' 4% tolerance): read when the run ends, so that
    # `--table` of the JSON judges it as the bench did, away from the run dir
    fp8_base: bool | None = None
    lora_cosine: float | None = None  # cosine of all LoRA tensors after the run, flattened together
    lora_up_cosine: float | None = None  # the same over lora_up only (zero at init: all of it was learned)
    # the lowest lora_up cosine of one kind of module over all blocks (`module_group`), and that kind: a fault in
    # one op shows there while the whole-LoRA cosines stay near 1 (cuDNN attention's gradient layout: 0.09 vs 0.763)
    lora_up_min_cosine: float | None = None
    lora_up_min_group: str | None = None
    run_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    # the model's architecture (its preset's model.model_type / model_version): which trainer, which tier targets
    model_type: str | None = None
    model_version: str | None = None
    plain_ratio: float | None = None  # --baseline: the plain trainer's s/step over ours (its speed-up: > 1 is faster)


def _reading(fn) -> float | None:
    try:
        return float(fn())
    except Exception:  # noqa: BLE001 - a board that does not report it
        return None


def case_cards(overrides: list[str], visible: str | None = None) -> list[int] | None:
    """NVML indices of the cards a case trains on: accelerate gives its N processes (`launcher.gpus=N`, default 1)
    the first N visible GPUs, which CUDA_VISIBLE_DEVICES (`visible`, else the environment's) may name by index;
    None for every visible card (`launcher.gpus=all`)."""
    gpus = _override(overrides, "launcher.gpus") or "1"
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    named = [v.strip() for v in visible.split(",")] if visible else []
    order = [int(v) for v in named] if named and all(v.isdigit() for v in named) else None
    if gpus.strip("'\"") == "all":
        return order
    n = int(gpus) if gpus.isdigit() else 1
    return (order or list(range(n)))[:n]


class CardPoller:
    """The cards a case trains on (`indices`, NVML's; None: every card) through NVML, sampled every 0.25 s on a
    thread: the peak of used memory of the fullest card, and the first card's power draw and SM clock with the time
    of each sample (`samples`). Nothing without NVML."""

    def __init__(self, indices: Sequence[int] | None = (0,), period_s: float = 0.25, nvml: Any = None) -> None:
        self.peak_bytes: int | None = None
        self.samples: list[tuple[float, float | None, float | None]] = []  # (time.time(), watts, MHz)
        self.energy: list[tuple[float, float]] = []  # (time.time(), joules on the first card's counter)
        self._stop = threading.Event()
        self._period = period_s
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            if indices is None:
                indices = list(range(nvml.nvmlDeviceGetCount()))
            self._nvml, self._handles = nvml, [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        except Exception:  # noqa: BLE001 - no NVML, no card: no reading
            self._nvml = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n, h = self._nvml, self._handles[0]
        while not self._stop.is_set():
            used = max(n.nvmlDeviceGetMemoryInfo(card).used for card in self._handles)
            self.peak_bytes = max(self.peak_bytes or 0, used)
            watts = _reading(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0)
            mhz = _reading(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
            self.samples.append((time.time(), watts, mhz))
            if (mj := _reading(lambda: n.nvmlDeviceGetTotalEnergyConsumption(h))) is not None:
                self.energy.append((time.time(), mj / 1e3))
            self._stop.wait(self._period)

    def __enter__(self) -> CardPoller:
        if self._nvml is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / 2**30

    def during(self, window: tuple[float, float] | None) -> dict:
        """`power_w` and `sm_clock_mhz`: the medians of the samples taken within `window` (wall times), each left
        out where there is none; `mean_power_w`: the energy counter's joules between its first and last reading in
        the window over the seconds between them (every watt counted, where a sample reads one instant)."""
        if window is None:
            return {}
        inside = [(w, c) for t, w, c in self.samples if window[0] <= t <= window[1]]
        out = {}
        for key, values in (("power_w", [w for w, _ in inside]), ("sm_clock_mhz", [c for _, c in inside])):
            values = [v for v in values if v is not None]
            if values:
                out[key] = statistics.median(values)
        energy = [(t, j) for t, j in self.energy if window[0] <= t <= window[1]]
        if len(energy) >= 2 and energy[-1][0] > energy[0][0]:
            out["mean_power_w"] = (energy[-1][1] - energy[0][1]) / (energy[-1][0] - energy[0][0])
        return out


# tags read as their largest value over the run (with several processes, rank 0 logs its own peaks every step and
# the largest of any process's torch peak every 25 steps, from the 25th)
PEAK_TAGS = {
    "vram/peak_gib": "torch_peak_gib",
    "vram/peak_gib_max_over_ranks": "torch_peak_gib",
    "vram/reserved_peak_gib": "reserved_peak_gib",
}
# tags read as their median after the warm-up (the first of two tags for one key wins)
LATE_TAGS = {
    "throughput/tflops": "tflops",
    "throughput/mfu": "mfu",
    "throughput/images_per_s_all_ranks": "images_per_s",
    "throughput/images_per_s": "images_per_s",
}


def step_stats(tb_dir: Path, warmup: int) -> dict:
    """s/step (median, min, max and mean after `warmup` steps) from loss event wall times, plus our own tags if
    present."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    wall: dict[int, float] = {}
    tags: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(Path(tb_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        scalars = acc.Tags().get("scalars", [])
        if "loss/current" in scalars:
            wall.update({e.step: e.wall_time for e in acc.Scalars("loss/current")})
        for tag in (*PEAK_TAGS, "time/step_s", "time/data_s", *LATE_TAGS):
            if tag in scalars:
                tags.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    steps = sorted(wall)
    deltas = [wall[b] - wall[a] for a, b in zip(steps, steps[1:], strict=False) if a >= warmup]
    out: dict = {"steps": len(steps), "first_wall": wall[steps[0]] if steps else None, "window": None}
    if deltas:
        out.update(s_per_step=statistics.median(deltas), s_min=min(deltas), s_max=max(deltas))
        out["window"] = (wall[steps[-1 - len(deltas)]], wall[steps[-1]])  # the measured steps' wall times
        out["s_mean"] = statistics.fmean(deltas)
    step_s, data_s = dict(tags.get("time/step_s", [])), dict(tags.get("time/data_s", []))
    if step_s and deltas:
        for key, step in zip(("step1_extra_s", "step2_extra_s"), sorted(step_s), strict=False):
            out[key] = step_s[step] - data_s.get(step, 0.0) - out["s_per_step"]
    for tag, key in PEAK_TAGS.items():
        if tags.get(tag):
            out[key] = max(out.get(key, 0.0), *(v for _, v in tags[tag]))
    for tag, key in LATE_TAGS.items():
        late = [v for s, v in tags.get(tag, []) if s > warmup]
        if late and key not in out:
            out[key] = statistics.median(late)
    return out


def losses(tb_dir: Path) -> dict[int, float]:
    from flux_trainer.metrics.tensorboard import read_scalars

    out: dict[int, float] = {}
    for folder in sorted({p.parent for p in Path(tb_dir).rglob("events.out.tfevents.*")}):
        out.update(read_scalars(folder).get("loss/current", []))
    return out


def lora_file(run_dir: Path) -> Path | None:
    """The run's final LoRA in its trainer's own format: the newest .safetensors directly in its folder (not in a
    subfolder: the plain trainer's run lives in ours' `baseline/`, and its LoRA, written later, is not ours), never
    the ComfyUI copy a musubi-tuner run of ours writes after it (the plain run has none: like is compared with like)."""
    from flux_trainer.musubi.lora_format import COMFY_SUFFIX  # the copy's name (stdlib-only module)

    files = [p for p in Path(run_dir).glob("*.safetensors") if not p.name.endswith(COMFY_SUFFIX)]
    files.sort(key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def cosine(a: list, b: list) -> float | None:
    """Cosine of the tensors in `a` and in `b`, each list flattened into one vector; 1 when both are all zeros."""
    import torch

    if not a:
        return None
    x, y = torch.cat([t.flatten().double() for t in a]), torch.cat([t.flatten().double() for t in b])
    if not (x.any() or y.any()):
        return 1.0
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


def module_group(key: str) -> str:
    """A LoRA tensor's kind of module, its block or layer index (the first number) written N:
    `lora_unet_double_blocks_7_img_mlp_0.lora_up.weight` -> `double_blocks_N_img_mlp_0`."""
    return re.sub(r"_\d+(?=_|$)", "_N", key.split(".")[0].removeprefix("lora_unet_"), count=1)


def compare_runs(ref_dir: Path, run_dir: Path) -> dict:
    """Numerics of one run against another with the same seed and data: per-step loss and the final LoRA."""
    from safetensors.torch import load_file

    out: dict = {}
    ref, got = losses(Path(ref_dir) / "tb"), losses(Path(run_dir) / "tb")
    common = sorted(set(ref) & set(got))
    if common:
        rel = [(got[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in common]
        out["loss_rel_diff"] = statistics.mean(abs(d) for d in rel)
        out["loss_rel_bias"] = statistics.mean(rel)
    ref_file, got_file = lora_file(ref_dir), lora_file(run_dir)
    if ref_file and got_file:
        a, b = load_file(str(ref_file)), load_file(str(got_file))
        keys = sorted(set(a) & set(b))
        out["lora_cosine"] = cosine([a[k] for k in keys], [b[k] for k in keys])
        up = [k for k in keys if "lora_up" in k]
        out["lora_up_cosine"] = cosine([a[k] for k in up], [b[k] for k in up])
        groups: dict[str, list[str]] = {}
        for k in up:
            groups.setdefault(module_group(k), []).append(k)
        if groups:
            worst = min((cosine([a[k] for k in ks], [b[k] for k in ks]), g) for g, ks in groups.items())
            out["lora_up_min_cosine"], out["lora_up_min_group"] = worst
    return out


def compare_kernel_sets(results: list[BenchResult], plan: list[tuple[str, list[str], int]], first: str) -> None:
    """Each case against the case with the same settings and the first kernel set, in place."""
    refs, reference = {}, kernel_overrides(first)
    for r, (_, overrides, res) in zip(results, plan, strict=True):
        at = next(i for i, o in enumerate(overrides) if o.startswith("kernels="))
        key = (tuple(overrides[:at]), res)  # the case's own overrides come before the kernel set's
        if overrides[at:] == reference:
            refs[key] = r
        elif key in refs and refs[key].run_dir and r.run_dir:
            r.compared_to = refs[key].case
            r.fp8_base = _fp8_base(r.run_dir)
            for k, v in compare_runs(Path(refs[key].run_dir), Path(r.run_dir)).items():
                setattr(r, k, v)


def compare_to_plain(ours: BenchResult, plain: BenchResult) -> None:
    """Our run's numerics against the plain trainer on the same TOMLs (same seed and data; none of our runner, hooks
    or kernels: a stricter reference than kernels=off, which still runs our runner), in place."""
    ours.compared_to = plain.case
    ours.fp8_base = _fp8_base(ours.run_dir)
    for k, v in compare_runs(Path(plain.run_dir), Path(ours.run_dir)).items():
        setattr(ours, k, v)
    files = [lora_file(Path(d)) for d in (ours.run_dir, plain.run_dir)]
    if None not in files:
        ours.notes.append(f"lora compared: {files[0]} against {files[1]}")


# issue 58's numerics per tier: the mean per-step loss difference within 2% with bf16 matmuls, 4% with fp8 ones
# (an fp8 base, where the card has fp8 matmuls), and the final LoRA's cosine at least 0.98
LOSS_TOLERANCE = {"bf16": 0.02, "fp8": 0.04}
LORA_COSINE_MIN = 0.98


def numerics_met(r: BenchResult) -> bool | None:
    """Whether a compared run's numerics are within the tolerance of its matmuls' precision; None where not compared."""
    if r.loss_rel_diff is None or r.lora_cosine is None:
        return None
    fp8 = _override(r.overrides, "precision") == "fp8_base" or (
        r.fp8_base if r.fp8_base is not None else _fp8_base(r.run_dir)
    )
    return r.loss_rel_diff <= LOSS_TOLERANCE["fp8" if fp8 else "bf16"] and r.lora_cosine >= LORA_COSINE_MIN


def _fp8_base(run_dir: str | None) -> bool:
    """The run's trainer TOML stores the base model in fp8 (a tier's own choice, not an override). Its keys sit in
    tables ([precision], [memory], ...), which the trainers flatten one level when they read the file: so here too."""
    for name in ("sd_scripts.toml", "musubi_tuner.toml"):
        toml = Path(run_dir or "") / name
        if run_dir and toml.is_file():
            import tomli

            doc = tomli.loads(toml.read_text())
            flat = {**{k: v for t in doc.values() if isinstance(t, dict) for k, v in t.items()}, **doc}
            return bool(flat.get("fp8_base"))
    return False


def _num(v: float | None, spec: str = ".4f") -> str:
    """A table cell: the number formatted, or '-' where it was not measured."""
    return "-" if v is None else format(v, spec)


def numerics_table(results: list[BenchResult]) -> str:
    head = (f"{'case':<36} {'against':<40} {'loss diff':>9} {'bias':>8} {'LoRA cos':>8} {'up cos':>8} "
            f"{'1st step +s':>11}  lowest up cos (module kind)")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in results:
        if r.compared_to:
            worst = "-" if r.lora_up_min_cosine is None else f"{r.lora_up_min_cosine:.4f} ({r.lora_up_min_group})"
            lines.append(
                f"{r.case[:36]:<36} {r.compared_to[:40]:<40} {_num(r.loss_rel_diff):>9} "
                f"{_num(r.loss_rel_bias, '+.4f'):>8} {_num(r.lora_cosine):>8} {_num(r.lora_up_cosine):>8} "
                f"{_num(r.step1_extra_s, '.1f'):>11}  {worst}"
            )
    return "\n".join(lines)


def bench_dataset(resolution: int, control: bool = False) -> tuple[Path, str]:
    """4 generated captioned images at the resolution, and a dataset config naming them; with `control` (FLUX.1
    Kontext) a reference image for each, the image mirrored, named as it is (`control_images:`)."""
    from flux_trainer.commands.dataset import write_dataset_config
    from flux_trainer.commands.demo import make_demo_dataset

    root = cache_root() / "bench"
    images = make_demo_dataset(root / f"images-{resolution}", n=4, size=resolution)
    name, extra = f"bench{resolution}", None
    if control:
        refs = references(images, root / f"refs-{resolution}")
        name, extra = f"bench{resolution}_control", {"control_images": str(refs)}
    write_dataset_config(root / "configs", name, images, resolution=resolution, repeats=10, force=True, extra=extra)
    return root / "configs", name


def references(images: Path, folder: Path) -> Path:
    """Each PNG of `images` mirrored left to right into `folder` under its own name: Kontext's reference images
    (written once; a reference newer than its image is kept)."""
    from PIL import Image, ImageOps

    folder.mkdir(parents=True, exist_ok=True)
    for image in sorted(images.glob("*.png")):
        ref = folder / image.name
        if not ref.is_file() or ref.stat().st_mtime < image.stat().st_mtime:
            tmp = folder / f".{image.name}.tmp.png"
            with Image.open(image) as im:
                ImageOps.mirror(im.convert("RGB")).save(tmp)
            tmp.replace(ref)
    return folder


def kernel_overrides(spec: str) -> list[str]:
    """A --kernels entry as overrides: 'fp8+kernels.cuda_graphs=true' -> the preset, then its own overrides."""
    name, *extra = spec.split("+")
    return [f"kernels={name}", *extra]


def cases(presets: list[str], kernels: list[str], resolutions: list[int]) -> list[tuple[str, list[str], int]]:
    out = []
    for preset, kernel, res in itertools.product(presets, kernels, resolutions):
        extra = preset.split("+") if preset else []
        kernel_extra = kernel_overrides(kernel)
        words = [*(e.split("=")[-1] for e in extra), *(e.split("=")[-1] for e in kernel_extra), str(res)]
        words[len(extra)] = f"k-{words[len(extra)]}"  # the kernel set's name
        name = "_".join(re.sub(r"[^\w.-]+", "-", w.strip("'\"")) for w in words)  # a file name: no quotes or commas
        out.append((name, [*extra, *kernel_extra], res))
    return out


def run_case(name: str, overrides: list[str], res: int, ns: argparse.Namespace, root: Path) -> BenchResult:
    from flux_trainer.commands.train import run_training
    from flux_trainer.config.paths import user_config_dirs

    model = bench_model(ns.model)
    configs, dataset = bench_dataset(res, control=model.model_type == "kontext")
    full = [
        f"+dataset={dataset}",
        f"model={ns.model}",
        "optimizer=adamw",
        f"train.max_steps={ns.warmup + ns.steps}",
        "train.save_every_n_steps=null",
        "train.save_state=false",
        f"logging.root={root}",
        f"train.output_name={name}",
        *overrides,
        *ns.overrides,
    ]
    t0 = time.time()
    with CardPoller(case_cards(full)) as poller:
        code = run_training(full, [*user_config_dirs(), configs])
    runs = sorted((root / name).glob("*/"))
    result = BenchResult(case=name, overrides=full, exit_code=code, card_peak_gib=poller.peak_gib,
                         model_type=model.model_type, model_version=model.model_version)  # fmt: skip
    if runs:
        result.run_dir = str(runs[-1])
        _measured(result, runs[-1] / "tb", ns.warmup, t0, poller)
    return result


def _measured(result: BenchResult, tb_dir: Path, warmup: int, t0: float, poller: CardPoller) -> None:
    """Fill in what a run's TensorBoard events (and the card's samples over its measured steps) say."""
    stats = step_stats(tb_dir, warmup)
    first = stats.pop("first_wall", None)
    result.first_step_s = None if first is None else first - t0
    stats.update(poller.during(stats.pop("window", None)))
    mean_power = stats.pop("mean_power_w", None)
    if mean_power is not None and stats.get("s_mean") is not None:
        stats["energy_j"] = mean_power * stats["s_mean"]
    for key, value in stats.items():
        setattr(result, key, value)


def run_baseline(ours: BenchResult, ns: argparse.Namespace) -> BenchResult:
    """The plain trainer on our run's own TOMLs, its output and TensorBoard in ours' `baseline/`, measured as ours
    is: plain sd-scripts' flux_train_network.py for a FLUX.1 run, plain musubi-tuner's training script for a FLUX.2 /
    Kontext run (flux_trainer.musubi.baseline: from our run's caches, not cached again); none of our runner or hooks."""
    from flux_trainer.backend import MUSUBI
    from flux_trainer.launch.supervise import run_supervised

    run_dir = Path(ours.run_dir)
    out = run_dir / "baseline"
    backend = json.loads((run_dir / "runner.json").read_text()).get("backend")
    if backend == MUSUBI:
        from flux_trainer.musubi.baseline import plain_command

        cmd = plain_command(run_dir, out)
    else:
        cmd = sd_scripts_command(run_dir, out)
    env = {**os.environ, **json.loads((run_dir / "env.json").read_text()).get("env", {})}
    env.pop(VRAM_CAP_ENV, None)
    t0 = time.time()
    with CardPoller(case_cards(ours.overrides)) as poller:
        code = run_supervised(cmd, env, out / "train.log")
    result = BenchResult(
        case=f"{ours.case} {PLAIN_SUFFIXES[backend or SDSCRIPTS]}",
        overrides=cmd,
        exit_code=code,
        card_peak_gib=poller.peak_gib,
        run_dir=str(out),
        model_type=ours.model_type,
        model_version=ours.model_version,
    )
    _measured(result, out / "tb", ns.warmup, t0, poller)
    return result


def sd_scripts_command(run_dir: Path, out: Path) -> list[str]:
    """Plain sd-scripts' flux_train_network.py on the run's TOMLs (accelerate launch, the run's accelerate.yaml)."""
    from flux_trainer.sdscripts.runner import RunnerSpec

    spec = RunnerSpec.read(run_dir)
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(run_dir / "accelerate.yaml"),
        "--quiet",
        str(Path(spec.sd_scripts) / "flux_train_network.py"),
        "--config_file",
        spec.train_toml,
        "--dataset_config",
        spec.dataset_toml,
        "--output_dir",
        str(out),
        "--logging_dir",
        str(out / "tb"),
    ]


# two tiers within this fraction of each other's s/step are equally fast: the same settings on two cards of one host
# measured 0.361 and 0.363 (vram32 and vram48, 2026-11-28); a larger tier is slower only beyond it
SAME_SPEED = 0.02

# a desktop card also drives a display: a tier plans for its size less this (the card's peak must stay under it)
DISPLAY_HEADROOM_GIB = 0.5


def case_cap(vram_cap: str | None, overrides: list[str]) -> float | None:
    """The cap for one case: a number, or with 'tier' its memory=vramNN tier's NN GiB less the display's headroom."""
    if not vram_cap:
        return None
    if vram_cap != "tier":
        return float(vram_cap)
    from flux_trainer.config.validate import tier_gib

    tier = _override(overrides, "memory") or ""
    return tier_gib(tier) - DISPLAY_HEADROOM_GIB if tier.startswith("vram") else None


# What each tier is meant to reach with FLUX.1-dev (H200 at the tier's cap, 1024², LoRA r16, batch 1): s/step, and the
# least speed-up over plain sd-scripts on the same TOMLs where one is set. A larger tier must also be no slower than a
# smaller one. Models trained on musubi-tuner have their own (bench_models.tier_target): a ratio, no s/step.
TIER_TARGETS = {
    "vram8": (0.80, 1.8),
    "vram12": (0.58, None),
    "vram16": (0.50, None),
    "vram24": (0.42, None),
    "vram32": (0.38, None),
    "vram48": (None, None),
    "vram80": (0.35, None),
}


def tier_cards() -> dict[str, list[str]]:
    """Each tier and the shipped cards (configs/hardware/) that memory=auto gives it."""
    from omegaconf import OmegaConf

    from flux_trainer.config.paths import shipped_config_dir
    from flux_trainer.config.tiers import tier_for_vram

    cards: dict[str, list[str]] = {}
    for path in sorted((shipped_config_dir() / "hardware").glob("*.yaml")):
        preset = OmegaConf.load(path)
        if preset.get("vram_gib"):
            cards.setdefault(tier_for_vram(float(preset.vram_gib)), []).append(path.stem)
    return cards


def _override(overrides: list[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"{key}=")), None)


def tier_rows(results: list[BenchResult]) -> list[dict]:
    """One row per tier: our run (the last kernel set measured on it), the plain trainer on its TOMLs, the ratio, the
    card peaks against the tier's size less the display's headroom, the target (the model's: FLUX.1-dev's s/step
    targets are not a 4B model's) and the numerics against the first kernel set where one was compared."""
    from flux_trainer.config.tiers import TIERS
    from flux_trainer.config.validate import tier_gib

    plain = {base: r for r in results if (base := plain_base(r.case)) is not None}
    ours: dict[str, BenchResult] = {}

    def rank(r: BenchResult) -> tuple[bool, bool]:
        return r.exit_code == 0 and r.s_per_step is not None, r.case in plain

    for r in results:  # per tier the last run that finished, with the plain trainer beside it where one has it
        tier = _override(r.overrides, "memory")
        if tier and plain_base(r.case) is None and (tier not in ours or rank(r) >= rank(ours[tier])):
            ours[tier] = r
    cards, rows = tier_cards(), []
    for tier in sorted(ours, key=lambda t: -TIERS.index(t) if t in TIERS else 0):
        r, b = ours[tier], plain.get(ours[tier].case)
        limit = (tier_gib(tier) or 0) - DISPLAY_HEADROOM_GIB
        target, speedup = tier_target(r.model_type, r.model_version, TIER_TARGETS.get(tier, (None, None)))
        ratio = b.s_per_step / r.s_per_step if b and b.s_per_step and r.s_per_step else None
        met = [
            r.exit_code == 0 and r.s_per_step is not None,
            target is None or (r.s_per_step is not None and r.s_per_step <= target),
            speedup is None or (ratio is not None and ratio >= speedup),
            r.card_peak_gib is not None and r.card_peak_gib <= limit,
            numerics_met(r) is not False,
        ]
        rows.append({
            "tier": tier, "cards": cards.get(tier, []), "kernels": _override(r.overrides, "kernels"),
            "settings": case_settings(r.overrides),
            "s_per_step": r.s_per_step, "plain_s_per_step": b.s_per_step if b else None, "ratio": ratio,
            "card_peak_gib": r.card_peak_gib, "plain_card_peak_gib": b.card_peak_gib if b else None,
            "torch_peak_gib": r.torch_peak_gib, "limit_gib": limit, "target_s_per_step": target,
            "target_ratio": speedup, "met": all(met), "loss_rel_diff": r.loss_rel_diff,
            "lora_cosine": r.lora_cosine, "compared_to": r.compared_to, "numerics_met": numerics_met(r),
            "first_step_s": r.first_step_s,
            "plain_first_step_s": b.first_step_s if b else None,
            "model_type": r.model_type, "model_version": r.model_version,
            "plain_trainer": plain_trainer(b.case) if b else None,
        })  # fmt: skip
    for smaller, larger in zip(rows, rows[1:], strict=False):  # a larger tier is never slower than a smaller one
        if None not in (smaller["s_per_step"], larger["s_per_step"]) and (
            larger["s_per_step"] > smaller["s_per_step"] * (1 + SAME_SPEED)
        ):
            larger["met"] = False
            larger["slower_than"] = smaller["tier"]
    return rows


def case_settings(overrides: list[str]) -> list[str]:
    """A bench run's own overrides beyond its tier and kernel set (those after `train.output_name=`, where run_case
    puts them): what makes the row other than the tier's defaults."""
    at = next((i for i, o in enumerate(overrides) if o.startswith("train.output_name=")), -1)
    return [o for o in overrides[at + 1 :] if not o.startswith(("memory=", "kernels="))]


def tier_table(rows: list[dict]) -> str:
    """The tier rows as a Markdown table (README's comes from it)."""
    trainers = sorted({w["plain_trainer"] for w in rows if w.get("plain_trainer")}) or ["sd-scripts"]
    lines = [
        f"| tier | cards (memory=auto) | flux-train s/step | plain {' / '.join(trainers)} | ratio | "
        "card peak ours / plain | limit | target | met | loss diff / LoRA cos (against) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in rows:
        target = " / ".join(x for x in (
            _num(w["target_s_per_step"], ".2f") if w["target_s_per_step"] else "",
            f">= {w['target_ratio']}x" if w["target_ratio"] else "",
            f"<= {w['slower_than']}" if w.get("slower_than") else "",
        ) if x) or "-"  # fmt: skip
        against = "plain" if plain_base(w.get("compared_to") or "") is not None else "kernels=off"
        numerics = (f"{w['loss_rel_diff'] * 100:.2f}% / {w['lora_cosine']:.4f} ({against})"
                    if w["loss_rel_diff"] is not None and w["lora_cosine"] is not None else "-")  # fmt: skip
        tier = w["tier"] + (f" ({', '.join(w['settings'])})" if w.get("settings") else "")
        ratio = "-" if w["ratio"] is None else f"{w['ratio']:.2f}x"
        lines.append(
            f"| {tier} | {', '.join(w['cards']) or '-'} | {_num(w['s_per_step'], '.3f')} "
            f"| {_num(w['plain_s_per_step'], '.3f')} | {ratio} "
            f"| {_num(w['card_peak_gib'], '.1f')} / {_num(w['plain_card_peak_gib'], '.1f')} GiB "
            f"| {w['limit_gib']:.1f} | {target} | {'yes' if w['met'] else 'NO'} | {numerics} |"
        )
    return "\n".join(lines)


def results_from(paths: list[Path]) -> list[BenchResult]:
    """Bench results read back from the JSON files earlier benches wrote."""
    out = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            out.append(BenchResult(**r))
    return out


def table(results: list[BenchResult]) -> str:
    head = (
        f"{'case':<40} {'exit':>4} {'s/step':>7} {'min-max':>13} {'mean':>6} {'torch pk':>8} {'rsv pk':>6} "
        f"{'card pk':>8} {'img/s':>5} {'TFLOP/s':>7} {'MFU':>5} {'W':>4} {'SM MHz':>6} {'J/step':>6} "
        f"{'1st step':>8} {'+s 1st/2nd':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        rng = f"{_num(r.s_min, '.3f')}-{_num(r.s_max, '.3f')}" if r.s_min is not None else "-"
        extra = f"{_num(r.step1_extra_s, '.1f')}/{_num(r.step2_extra_s, '.1f')}"
        lines.append(
            f"{r.case[:40]:<40} {r.exit_code:>4} {_num(r.s_per_step, '.3f'):>7} {rng:>13} {_num(r.s_mean, '.3f'):>6} "
            f"{_num(r.torch_peak_gib, '.1f'):>8} {_num(r.reserved_peak_gib, '.1f'):>6} "
            f"{_num(r.card_peak_gib, '.1f'):>8} {_num(r.images_per_s, '.2f'):>5} {_num(r.tflops, '.0f'):>7} "
            f"{_num(r.mfu, '.2f'):>5} "
            f"{_num(r.power_w, '.0f'):>4} {_num(r.sm_clock_mhz, '.0f'):>6} {_num(r.energy_j, '.0f'):>6} "
            f"{_num(r.first_step_s, '.0f'):>8} {extra:>11}"
        )
    return "\n".join(lines)


def ratio_table(results: list[BenchResult]) -> str:
    """Each case that has the plain trainer's run beside it: both s/step and the ratio."""
    plain = {base: r for r in results if (base := plain_base(r.case)) is not None}
    head = f"{'case':<40} {'s/step':>7} {'plain':>7} {'ratio':>6}  plain trainer"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.case in plain:
            b = plain[r.case]
            ratio = "-" if r.plain_ratio is None else f"{r.plain_ratio:.2f}x"
            lines.append(f"{r.case[:40]:<40} {_num(r.s_per_step, '.3f'):>7} {_num(b.s_per_step, '.3f'):>7} "
                         f"{ratio:>6}  {plain_trainer(b.case)}")  # fmt: skip
    return "\n".join(lines)


def abba_summary(first: list[BenchResult], second: list[BenchResult]) -> list[dict]:
    """Each case's s/step in both passes (the second ran in reverse order) and their mean, and that mean over the
    first case's. Over the two passes a drift that is linear in time (clocks, temperature, caches filling) adds
    the same to every case's mean, so it cancels out of the comparison."""
    rows = []
    for a, b in zip(first, second, strict=True):
        both = (a.s_per_step, b.s_per_step)
        rows.append({"case": a.case, "s_per_step_1": both[0], "s_per_step_2": both[1],
                     "mean": None if None in both else (both[0] + both[1]) / 2})  # fmt: skip
    ref = rows[0]["mean"] if rows else None
    for row in rows:
        row["vs_first"] = None if ref is None or row["mean"] is None else row["mean"] / ref
    return rows


def abba_table(rows: list[dict]) -> str:
    head = f"{'case':<36} {'pass 1':>7} {'pass 2':>7} {'mean':>7} {'vs 1st':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case'][:36]:<36} {_num(r['s_per_step_1']):>7} {_num(r['s_per_step_2']):>7} "
                     f"{_num(r['mean']):>7} {_num(r['vs_first'], '.3f'):>7}")  # fmt: skip
    return "\n".join(lines)


def bench_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="flux-train bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["memory=vram80"],
        help="override sets, '+' joins several: memory=vram48 memory=vram24+precision=fp8_base",
    )
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=None,
        help="kernel sets (default off; with --tiers auto): off auto ...; '+' adds overrides "
        "for that set alone (fp8+kernels.cuda_graphs=true); with several, each case's per-step loss and "
        "final LoRA are compared with the first set's (same seed and data)",
    )
    ap.add_argument("--resolution", nargs="+", type=int, default=[1024])
    ap.add_argument(
        "--model",
        default="random",
        help="random (FLUX.1-dev full size, default), random_tiny, random_chroma, random_chroma_tiny; on musubi-tuner: "
        "random_flux2_klein_4b, random_flux2_klein_9b, random_kontext (full size), random_flux2_klein_tiny, "
        "random_kontext_tiny",
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="measured steps after the warm-up")
    ap.add_argument("--baseline", action="store_true", help="also run the plain trainer (sd-scripts, or musubi-tuner "
                    "for FLUX.2 / Kontext) on each case's TOMLs")  # fmt: skip
    ap.add_argument(
        "--vram-cap",
        help="treat the card as having this many GiB (its CUDA context included); 'tier': each "
        "case's memory=vramNN tier's NN GiB less a display's 0.5",
    )
    ap.add_argument("--root", type=Path, default=Path("runs") / "bench", help="where the bench runs go")
    ap.add_argument("--json", type=Path, help="write the results here (default <root>/bench-<time>.json)")
    ap.add_argument("--abba", action="store_true", help="run every case twice, the second pass in reverse order "
                    "(A B B A), and compare the cases' mean s/step over both passes")  # fmt: skip
    ap.add_argument("--tiers", nargs="*", metavar="TIER", help="every memory tier (or those named; FLUX.2 klein: "
                    "its own, 4B vram8 vram12 vram16, 9B vram12 vram16 vram24) at its size less the display's 0.5 GiB "
                    "(--vram-cap tier), the plain trainer beside each (--baseline); prints the tier table")  # fmt: skip
    ap.add_argument("--table", nargs="+", type=Path, metavar="JSON", help="print the tier table of earlier benches' "
                    "JSON files (tiers measured apart, on several machines) and stop")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every case")
    ns = ap.parse_args(argv)
    if ns.table:
        print(tier_table(tier_rows(results_from(ns.table))))
        return 0
    if ns.tiers is not None:
        from flux_trainer.config.tiers import TIERS

        unknown = [t for t in ns.tiers if t not in TIERS]
        if unknown:
            ap.error(f"--tiers {' '.join(unknown)}: choose from {' '.join(reversed(TIERS))}")
        ns.cases = [f"memory={t}" for t in (ns.tiers or default_tiers(bench_model(ns.model)) or reversed(TIERS))]
        ns.kernels = ns.kernels or ["auto"]
        ns.vram_cap, ns.baseline = ns.vram_cap or "tier", True
    ns.kernels = ns.kernels or ["off"]
    root = ns.root.resolve()
    results, plan = [], cases(ns.cases, ns.kernels, ns.resolution)
    ours, again = [], []
    runs = [(name, overrides, res, 1) for name, overrides, res in plan]
    if ns.abba:  # the second pass in reverse order, its runs named <case>_2 (the baseline runs in the first only)
        runs += [(f"{name}_2", overrides, res, 2) for name, overrides, res in reversed(plan)]
    for name, overrides, res, run_pass in runs:
        cap = case_cap(ns.vram_cap, overrides)
        if cap:
            os.environ[VRAM_CAP_ENV] = str(cap)
        else:
            os.environ.pop(VRAM_CAP_ENV, None)
        print(f"[flux-train bench] {name}: {' '.join(overrides)} at {res}px, VRAM cap {cap or 'none'}", flush=True)
        results.append(run_case(name, overrides, res, ns, root))
        results[-1].notes.append(f"vram_cap_gib={cap}")
        (ours if run_pass == 1 else again).append(results[-1])
        # the plain trainer once per case, on the TOMLs of its last kernel set (the one a tier table reports)
        last_set = overrides[-len(kernel_overrides(ns.kernels[-1])) :] == kernel_overrides(ns.kernels[-1])
        baseline = ns.baseline and run_pass == 1 and last_set and results[-1].run_dir
        if baseline:
            results.append(run_baseline(results[-1], ns))
            if results[-2].s_per_step and results[-1].s_per_step:
                results[-2].plain_ratio = results[-1].s_per_step / results[-2].s_per_step
            if len(ns.kernels) == 1 and results[-1].run_dir:  # one kernel set: its numerics against the plain run
                compare_to_plain(results[-2], results[-1])
        print(table(results[-2 if baseline else -1 :]), flush=True)
    text = table(results)
    print("\n" + text)
    if any(plain_base(r.case) for r in results):
        print(f"\nagainst the plain trainer on the same TOMLs (ratio: its s/step over ours)\n{ratio_table(results)}")
    abba = abba_summary(ours, again[::-1]) if ns.abba else None
    if abba:
        print(f"\nA B B A: each case's s/step in both passes and their mean\n{abba_table(abba)}")
    if len(ns.kernels) > 1:
        compare_kernel_sets(ours, plan, ns.kernels[0])
    if any(r.compared_to for r in ours):
        trainer = plain_trainer(bench_model(ns.model).plain_suffix)
        against = f"kernels={ns.kernels[0]}" if len(ns.kernels) > 1 else f"plain {trainer} on the same TOMLs"
        print(f"\nnumerics against {against} (same seed and data; 1st step +s: its compute time minus "
              f"the median step)\n{numerics_table(ours)}")  # fmt: skip
    tiers = tier_rows(results) if ns.tiers is not None else None
    if tiers:
        print(
            f"\nmemory tiers (card peaks against the tier's size less {DISPLAY_HEADROOM_GIB} GiB)\n{tier_table(tiers)}"
        )
    out = ns.json or root / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "vram_cap_gib": ns.vram_cap,
                "warmup": ns.warmup,
                "steps": ns.steps,
                "results": [asdict(r) for r in results],
                **({"abba": abba} if abba else {}),
                **({"tiers": tiers} if tiers else {}),
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0 if all(r.exit_code == 0 for r in results) else 1
