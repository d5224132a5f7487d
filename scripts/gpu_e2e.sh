#!/usr/bin/env bash
# One call on the lent GPU machine (../shared/GPU.md): full-size RANDOM FLUX.1-dev, 1024², LoRA r16, batch 1,
# AdamW, cached latents/text-encoder outputs; plain sd-scripts (our TOMLs, its own script) and flux-train side
# by side, then a step-time/memory table from the TensorBoard events. Needs carry: .whl (../shared/gpu/wheels.sh)
# and .gpu/sd-scripts. Usage: bash scripts/gpu_e2e.sh [STEPS] [RUN ...]   RUN: plain | ours | ours_kernels
set -euo pipefail
STEPS=${1:-35}; shift || true
RUNS=${*:-plain ours}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$REPO FLUX_TRAIN_SD_SCRIPTS=$REPO/.gpu/sd-scripts FLUX_TRAIN_CACHE=/tmp/ftcache
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
W=/tmp/work; mkdir -p "$W/configs/dataset" "$W/pics"; cd "$W"
python3 - <<'PY'
from PIL import Image, ImageDraw
for i in range(4):
    im = Image.new("RGB", (1024, 1024), (40 * i, 90, 200 - 30 * i))
    ImageDraw.Draw(im).ellipse((100 + 50 * i, 200, 700, 800), fill=(230, 60 + 40 * i, 40))
    im.save(f"/tmp/work/pics/im{i}.png")
    open(f"/tmp/work/pics/im{i}.txt", "w").write(f"a coloured disc on a plain background, picture {i}")
PY
printf 'name: bench\nimages: /tmp/work/pics\nresolution: 1024\nrepeats: 10\n' > configs/dataset/bench.yaml
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -c "
from pathlib import Path
from flux_trainer.sdscripts.random_model import ensure_random_model
ensure_random_model(Path('/tmp/ftcache/models'), 'full', device='cuda', log=print)"
echo "random model: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/timing.txt"
COMMON=(+dataset=bench model=random optimizer=adamw "train.max_steps=$STEPS" train.save_every_n_steps=null
        train.save_state=false train.data_loader_workers=2 logging.root=$W/runs)
poll() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/smi_$1.csv" & echo $!; }
# the TOMLs come from flux-train's dry run, so plain sd-scripts gets exactly the same settings
python3 -m flux_trainer.cli "${COMMON[@]}" kernels=off dry_run=true > "$OUT/dry.txt" 2>&1
RUN=$(ls -d $W/runs/bench/*/ | tail -1)
cp "$RUN/sd_scripts.toml" "$RUN/dataset.toml" "$OUT/"
STATS=()
for r in $RUNS; do
  pid=$(poll "$r"); t0=$(date +%s)
  case $r in
    plain) python3 -m accelerate.commands.launch --config_file "$RUN/accelerate.yaml" --quiet \
             "$REPO/.gpu/sd-scripts/flux_train_network.py" --config_file "$RUN/sd_scripts.toml" \
             --dataset_config "$RUN/dataset.toml" --output_dir "$W/plain" --logging_dir "$W/plain/tb" \
             > "$OUT/log_plain.txt" 2>&1 || echo "plain failed: $?" ;
           TB=$W/plain/tb ;;
    ours) python3 -m flux_trainer.cli "${COMMON[@]}" kernels=off > "$OUT/log_ours.txt" 2>&1 || echo "ours failed: $?" ;
           TB=$(ls -d $W/runs/bench/*/ | tail -1)/tb ;;
    ours_kernels) python3 -m flux_trainer.cli "${COMMON[@]}" kernels=auto > "$OUT/log_ours_kernels.txt" 2>&1 \
             || echo "ours_kernels failed: $?" ; TB=$(ls -d $W/runs/bench/*/ | tail -1)/tb ;;
  esac
  kill "$pid" || true
  echo "$r: $(( $(date +%s) - t0 )) s wall incl. start-up and caching" | tee -a "$OUT/timing.txt"
  STATS+=("$r=$TB:$OUT/smi_$r.csv")
done
python3 "$REPO/scripts/step_stats.py" "${STATS[@]}" --warmup 5 --json "$OUT/step_stats.json" | tee "$OUT/step_stats.txt"
python3 - <<'PY' | tee "$OUT/tags.txt"
import glob, os
from flux_trainer.metrics.tensorboard import read_scalars, read_texts
runs = sorted(glob.glob("/tmp/work/runs/bench/*/tb"))
for tb in runs[1:]:
    for d in sorted({os.path.dirname(p) for p in glob.glob(tb + "/**/events.out.tfevents.*", recursive=True)}):
        s = read_scalars(d)
        print(d)
        for tag in sorted(s):
            vals = [v for _, v in s[tag]]
            print(f"  {tag:<28} n={len(vals):<3} last={vals[-1]:.4g} max={max(vals):.4g}")
        print("  texts:", sorted(read_texts(d)))
PY
