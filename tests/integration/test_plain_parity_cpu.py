"""Our run against plain sd-scripts on the same TOMLs, on the CPU: with kernels off, the runner must train exactly the
steps sd-scripts alone trains (the same LoRA init, batch order, noise and timesteps), so `flux-train bench` can judge
the kernels' numerics against plain sd-scripts. Equal, not close: the same draws into the same arithmetic.

Plain sd-scripts runs second, reusing the latent and text-encoder caches our run built (as in the bench), so this also
holds our runner to drawing the same whether it built the caches or not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flux_trainer.commands.bench import compare_runs, losses
from tests.integration.tiny_run import flux_train, fresh_env, need_checkout, newest_run, tiny_dataset

pytestmark = pytest.mark.sd_scripts


@pytest.mark.parametrize("kernels", ["off", "auto"])
def test_a_run_trains_the_steps_plain_sd_scripts_trains(tmp_path, kernels):
    need_checkout()
    tiny_dataset(tmp_path)
    proc = flux_train(tmp_path, "+dataset=tiny", "model=random_tiny", f"kernels={kernels}", "train.max_steps=6",
                      "train.save_every_n_steps=null")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = newest_run(tmp_path)
    env = {**fresh_env(tmp_path), "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}  # as env.json has them
    plain = subprocess.run([sys.executable, "-m", "tests.integration.plain_sd_scripts", str(run_dir),
                            str(run_dir / "baseline")], cwd=str(_repo()), env=env, capture_output=True, text=True,
                           timeout=900)  # fmt: skip
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    ours, ref = losses(run_dir / "tb"), losses(run_dir / "baseline" / "tb")
    assert sorted(ours) == sorted(ref) == list(range(1, 7))
    for step, loss in ref.items():  # the 4 images come in a different order each of the 2 epochs
        assert abs(ours[step] - loss) <= 1e-6 * abs(loss), (step, ours[step], loss)
    numerics = compare_runs(run_dir / "baseline", run_dir)
    assert numerics["lora_up_cosine"] > 0.99999, numerics


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]
