#!/usr/bin/env bash
# `flux-train bench` on the lent GPU machine (../shared/GPU.md), one call: install the carried wheels, generate
# the random full-size model, run the bench with the given arguments, dump every TensorBoard tag of the runs.
# carry: .whl (../shared/gpu/wheels.sh) and .gpu/sd-scripts (and .gpu/musubi-tuner for FLUX.2 / Kontext).
# Usage: [TAG=name] bash scripts/gpu_bench.sh BENCH_ARGS...
# (BENCH_ARGS naming a musubi-tuner model, `--model random_flux2_klein_4b`, `random_flux2_klein_9b` or
#  `random_kontext`: that random set is generated instead of FLUX.1's, and FLUX_TRAIN_MUSUBI_TUNER is
#  $REPO/.gpu/musubi-tuner; random_kontext's files are FLUX.1's random set, so it is the same generation)
# (TAG names the run root /tmp/TAG and the files $OUT/TAG.json, .log, -tags.txt: several benches in one call;
#  KERNELS=dir runs another copy of kernels/ as flux_kernels, to compare two versions of a kernel in one call;
#  EXTRA_PYTHONPATH=dirs goes first on the path: packages installed apart, such as flash-attn-4;
#  SETUP_ONLY=1 installs and generates the model, then stops: run it once before benches in parallel, one per GPU
#  with CUDA_VISIBLE_DEVICES=N, each with its own FLUX_TRAIN_CACHE=/tmp/ftcacheN sharing /tmp/ftcache's model)
set -euo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; TAG=${TAG:-bench}
REPO=$PWD
# once per machine (a reinstall would give the files new times and make their bytecode stale), with bytecode as a pip
# install leaves it: the lent machine's Python writes none on import, so without it every process would compile
# transformers' and diffusers' sources again (~5 s of each start)
[ -f /tmp/site/.installed ] || {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING || true
  python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1 || true; touch /tmp/site/.installed; }
python3 -m compileall -q -j 0 "$REPO/flux_trainer" "$REPO/kernels" "$REPO/.gpu/sd-scripts" > /dev/null 2>&1 || true
[ ! -d "$REPO/.gpu/musubi-tuner" ] || python3 -m compileall -q -j 0 "$REPO/.gpu/musubi-tuner/src" > /dev/null 2>&1 || true
mkdir -p /tmp/pkgs && ln -sfn "${KERNELS:-$REPO/kernels}" /tmp/pkgs/flux_kernels   # the wheel maps kernels/ -> flux_kernels
CACHE=${FLUX_TRAIN_CACHE:-/tmp/ftcache}
if [ "$CACHE" != /tmp/ftcache ]; then mkdir -p "$CACHE" /tmp/ftcache/models && ln -sfn /tmp/ftcache/models "$CACHE/models"; fi
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}/tmp/site:/tmp/pkgs:$REPO FLUX_TRAIN_SD_SCRIPTS=$REPO/.gpu/sd-scripts FLUX_TRAIN_CACHE=$CACHE
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
MODEL=random; prev=
for arg in "$@"; do   # the bench's --model (its default: FLUX.1's random)
  case "$arg" in --model=*) MODEL=${arg#--model=} ;; esac
  [ "$prev" != --model ] || MODEL=$arg; prev=$arg
done
MUSUBI_MODEL=$(python3 -c "
from flux_trainer.musubi.random_specs import FLUX2_PRESETS, KONTEXT_PRESETS
print('$MODEL' if '$MODEL' in {**FLUX2_PRESETS, **KONTEXT_PRESETS} else '')")
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "$MUSUBI_MODEL" ]; then
  export FLUX_TRAIN_MUSUBI_TUNER=$REPO/.gpu/musubi-tuner
  python3 -c "
from pathlib import Path
from flux_trainer.musubi.random_model import ensure_random_musubi_model
ensure_random_musubi_model(Path('/tmp/ftcache/models'), '$MUSUBI_MODEL', device='cuda', log=print)" | tail -2
else
  python3 -c "
from pathlib import Path
from flux_trainer.sdscripts.random_model import ensure_random_model
ensure_random_model(Path('/tmp/ftcache/models'), 'full', device='cuda', log=print)" | tail -2
fi
[ -z "${SETUP_ONLY:-}" ] || exit 0
python3 -m flux_trainer.cli bench --root "/tmp/$TAG" --json "$OUT/$TAG.json" "$@" > "$OUT/$TAG.log" 2>&1 || echo "bench exit $?"
grep -B2 -A40 "^case" "$OUT/$TAG.log" | grep -v "Directory watcher\|No path found" | tail -24
TAG=$TAG OUT=$OUT python3 - <<'PY' > "$OUT/$TAG-tags.txt"
import glob, json, os
from flux_trainer.metrics.tensorboard import read_scalars, read_texts
losses = {}
for d in sorted({os.path.dirname(p) for p in glob.glob(f"/tmp/{os.environ['TAG']}/*/*/tb/**/events.out.tfevents.*", recursive=True)}):
    s, t = read_scalars(d), read_texts(d)
    losses[d] = s.get("loss/current", [])
    print(d)
    for tag in sorted(s):
        vals = [v for _, v in s[tag]]
        late = sorted(vals[len(vals) // 2:])  # the later half, past the start-up's outliers
        print(f"  {tag:<28} n={len(vals):<3} first={vals[0]:.4g} last={vals[-1]:.4g} max={max(vals):.4g} late-median={late[len(late) // 2]:.4g}")
    for k, v in sorted(t.items()):
        print(f"  text {k}: {v[:160]!r}")
json.dump(losses, open(os.path.join(os.environ["OUT"], os.environ["TAG"] + "-losses.json"), "w"))
PY
grep -E "^/|loss/current|vram/peak|time/step_s|run/kernels" "$OUT/$TAG-tags.txt" | head -40
