"""Resume and step time on the GPU, one command on the lent machine (docs/performance.md, "Resume on the GPU").

Four runs of the random full-size FLUX.1-dev (`model=random`), the same seed, data and settings:
  A  this tree, N steps uninterrupted
  B  another tree (`--base DIR`: a checkout of the commit to compare with), the same N steps: s/step beside A's
  C1 this tree, stopped with SIGINT once a state after step `--stop-after` exists
  C2 this tree, `resume=auto` from C1's state to N
Prints a table (s/step: the median of the later half of `time/step_s`; peak GiB; steps; the loss differences of
C1+C2 against A) and writes JSON. Run by scripts/gpu_bench.sh's set-up (wheels, the random model).

    python3 scripts/gpu_resume.py --root /tmp/res --base .gpu/base --steps 24 --stop-after 8 --json $OUT/resume.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from flux_trainer.metrics.tensorboard import read_scalars

    out: dict[str, dict[int, float]] = {}
    for events in {p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")}:
        for tag, values in read_scalars(events).items():
            out.setdefault(tag, {}).update(dict(values))
    return out


def make_dataset(root: Path, n: int, size: int) -> None:
    import numpy as np
    from PIL import Image

    images = root / "pics"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(images / f"im{i}.png")
        (images / f"im{i}.txt").write_text(f"a test picture number {i}")
    (root / "configs" / "dataset").mkdir(parents=True, exist_ok=True)
    (root / "configs" / "dataset" / "gpu.yaml").write_text(
        f"name: gpu\nimages: {images}\nresolution: {size}\nrepeats: 1\n"
    )


def command(steps: int, save_every: int, extra: list[str]) -> list[str]:
    """The same run for every row: only `extra` (resume=auto) differs."""
    return [sys.executable, "-m", "flux_trainer.cli", "+dataset=gpu", "model=random", "memory=vram80",
            f"train.max_steps={steps}", f"train.save_every_n_steps={save_every}", *extra]  # fmt: skip


def run(root: Path, env: dict, cmd: list[str], log: Path, stop_after: int | None = None) -> int:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
        while stop_after is not None and proc.poll() is None:
            done = [p for p in root.glob("runs/gpu/*/gpu-step*-state") if step_of(p) > stop_after]
            if done:
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.2)
        return proc.wait(timeout=900)


def step_of(state: Path) -> int:
    return int(re.findall(r"\d{8}", state.name)[0])


def newest(root: Path) -> Path:
    return sorted(p for p in (root / "runs" / "gpu").iterdir() if p.is_dir())[-1]


def late_median(values: dict[int, float]) -> float:
    steps = sorted(values)
    late = [values[s] for s in steps[len(steps) // 2 :]]
    return statistics.median(late) if late else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--base", type=Path, help="a checkout to run as B (flux_trainer, configs, kernels)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--stop-after", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    rows = {}
    env = dict(os.environ)
    order = (("A", None, [], None), ("C1", None, [], ns.stop_after), ("C2", None, ["resume=auto"], None),
             ("B", ns.base, [], None))  # fmt: skip
    for name, tree, extra, stop in order:
        if name == "B" and tree is None:
            continue
        root = ns.root / ("C" if name.startswith("C") else name)
        if not (root / "configs").exists():
            make_dataset(root, 8, ns.size)
        e = dict(env)
        if tree is not None:
            shim = ns.root / "base_pkgs"
            shim.mkdir(parents=True, exist_ok=True)
            link = shim / "flux_kernels"
            if not link.exists():
                link.symlink_to((tree / "kernels").resolve())
            e["PYTHONPATH"] = f"{shim}:{tree.resolve()}:{env.get('PYTHONPATH', '')}"
        t = time.time()
        code = run(root, e, command(ns.steps, ns.save_every, extra), ns.root / f"{name}.log", stop)
        run_dir = newest(root)
        s = scalars(run_dir)
        rows[name] = {
            "exit": code,
            "wall_s": round(time.time() - t, 1),
            "steps": sorted(s.get("loss/current", {})),
            "s_per_step": late_median(s.get("time/step_s", {})),
            "peak_gib": max(s.get("vram/peak_gib", {0: float("nan")}).values()),
            "loss": s.get("loss/current", {}),
        }
        tail = (ns.root / f"{name}.log").read_text(errors="replace").splitlines()[-3:]
        rows[name]["said"] = tail
        r = rows[name]
        print(
            f"{name}: exit {code}, steps {r['steps'][:1]}..{r['steps'][-1:]}, {r['s_per_step']:.4f} s/step, "
            f"peak {r['peak_gib']:.1f} GiB, {r['wall_s']} s; {tail[-1][:200] if tail else ''}",
            flush=True,
        )
    a = rows["A"]["loss"]
    resumed = {**rows["C1"]["loss"], **rows["C2"]["loss"]}
    diffs = {s: abs(resumed[s] - a[s]) / abs(a[s]) for s in a if s in resumed}
    k = max(rows["C1"]["loss"]) if rows["C1"]["loss"] else 0
    print(f"{'run':<4} {'exit':>4} {'steps':>9} {'s/step':>8} {'peak GiB':>9} {'wall s':>7}")
    for name, r in rows.items():
        span = f"{r['steps'][0]}-{r['steps'][-1]}" if r["steps"] else "-"
        print(f"{name:<4} {r['exit']:>4} {span:>9} {r['s_per_step']:>8.4f} {r['peak_gib']:>9.1f} {r['wall_s']:>7}")
    before = [d for s, d in diffs.items() if s <= k]
    after = [d for s, d in diffs.items() if s > k]
    print(f"stopped at step {k}; loss rel. diff vs A: steps 1-{k} max {max(before, default=0):.2e}, "
          f"steps {k + 1}-{ns.steps} max {max(after, default=0):.2e}")  # fmt: skip
    if "B" in rows:
        print(f"s/step A/B: {rows['A']['s_per_step'] / rows['B']['s_per_step']:.4f}")
    if ns.json:
        for r in rows.values():
            r["loss"] = {str(s): v for s, v in r["loss"].items()}
        ns.json.write_text(json.dumps({"rows": rows, "stopped_at": k, "rel_diff": diffs}, indent=1) + "\n")
    shutil.rmtree(ns.root / "base_pkgs", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
