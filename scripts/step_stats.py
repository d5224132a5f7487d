"""Steady-state step time and memory of finished runs, read from their TensorBoard events.

Works for flux-train runs and for plain sd-scripts runs alike: s/step comes from the wall time between
successive `loss/current` events (sd-scripts logs one per optimizer step, after `loss.item()` has synced the
device), so both are measured the same way. Also reports flux-train's own `time/step_s` and `vram/peak_gib`
where present, and the peak of an nvidia-smi memory log (`--smi FILE`, MiB per line) when given.

    python scripts/step_stats.py NAME=TBDIR[:SMI_CSV] ... [--warmup 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def wall_times(tb_dir: Path, tag: str = "loss/current") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: dict[int, float] = {}
    for events in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            points.update({e.step: e.wall_time for e in acc.Scalars(tag)})
        for extra in ("time/step_s", "vram/peak_gib"):
            if extra in acc.Tags().get("scalars", []):
                points.setdefault(f"_{extra}", [e.value for e in acc.Scalars(extra)])  # type: ignore[arg-type]
    return points  # type: ignore[return-value]


def stats(name: str, tb_dir: Path, smi: Path | None, warmup: int) -> dict:
    points = wall_times(tb_dir)
    steps = sorted(k for k in points if isinstance(k, int))
    deltas = [points[b] - points[a] for a, b in zip(steps, steps[1:], strict=False) if a >= warmup]
    row = {
        "run": name,
        "steps": len(steps),
        "median_s_per_step": statistics.median(deltas) if deltas else None,
        "min_s": min(deltas) if deltas else None,
        "max_s": max(deltas) if deltas else None,
    }
    if "_time/step_s" in points:
        own = points["_time/step_s"][warmup:]
        row["flux_train_time_step_s_median"] = statistics.median(own) if own else None
    if "_vram/peak_gib" in points:
        row["torch_peak_allocated_gib"] = max(points["_vram/peak_gib"])
    if smi and smi.exists():
        used = [float(x) for x in smi.read_text().split() if x.replace(".", "", 1).isdigit()]
        row["nvidia_smi_peak_gib"] = max(used) / 1024 if used else None
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="NAME=TBDIR[:SMI_CSV]")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    rows = []
    for spec in ns.runs:
        name, rest = spec.split("=", 1)
        tb, _, smi = rest.partition(":")
        rows.append(stats(name, Path(tb), Path(smi) if smi else None, ns.warmup))
    base = rows[0]["median_s_per_step"]
    print(f"{'run':<28} {'steps':>5} {'s/step':>8} {'min':>7} {'max':>7} {'ratio':>6} {'torch pk':>8} {'smi pk':>7}")
    for r in rows:
        ratio = base / r["median_s_per_step"] if base and r["median_s_per_step"] else None

        def f(v, spec=".3f"):
            return format(v, spec) if isinstance(v, (int, float)) else "-"

        print(
            f"{r['run']:<28} {r['steps']:>5} {f(r['median_s_per_step']):>8} {f(r['min_s']):>7} {f(r['max_s']):>7} "
            f"{f(ratio, '.2f'):>6} {f(r.get('torch_peak_allocated_gib'), '.1f'):>8} "
            f"{f(r.get('nvidia_smi_peak_gib'), '.1f'):>7}"
        )
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
