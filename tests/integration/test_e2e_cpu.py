"""A real training run on CPU through sd-scripts' own trainer: tiny random FLUX, 2 steps, through the same
path as `flux-train` (Hydra composition, translation, run dir, accelerate launch, runner subclass)."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest

from tests.integration.tiny_run import cli, fresh_env, need_checkout, tiny_dataset

pytestmark = pytest.mark.sd_scripts


def losses(run_dir) -> list[float]:
    """loss/current of a run, step by step, from its TensorBoard events."""
    from flux_trainer.metrics.tensorboard import read_scalars

    return [v for _, v in read_scalars(next((run_dir / "tb").rglob("events.out.tfevents.*")).parent)["loss/current"]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    need_checkout()
    work = tmp_path_factory.mktemp("e2e")
    tiny_dataset(work)
    # no tokenizer folder configured: random presets use the packaged stand-ins, so nothing is downloaded; a cache
    # folder of its own (the random model, the base model's sha256...), as on a fresh machine
    env = fresh_env(work)
    cmd = cli(
        "+dataset=tiny",
        "model=random_tiny",
        "train.max_steps=2",
        "train.save_every_n_steps=1",
        "train.data_loader_workers=0",
        "memory=cpu",
        "sample.prompts=[a flat colour square]",
        "sample.every_n_steps=2",
        "sample.steps=2",
        "sample.width=64",
        "sample.height=64",
        "logging.profile_at=2",  # the run ends inside the 3-step window: the profile closes with the 1 step it saw
        "logging.memory_snapshot_at=1",  # a CPU run: says so, records nothing
    )
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    runs = sorted((work / "runs" / "tiny").glob("*"))

    def rerun(*extra):
        return subprocess.run([*cmd, *extra], cwd=work, env=env, capture_output=True, text=True, timeout=900)

    return SimpleNamespace(proc=proc, run_dir=runs[-1] if runs else None, rerun=rerun, cache=work / "cache")


def test_run_succeeds(trained):
    proc, run_dir = trained.proc, trained.run_dir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run_dir is not None
    for name in ("config.yaml", "sd_scripts.toml", "dataset.toml", "command.txt", "env.json", "train.log"):
        assert (run_dir / name).is_file(), name
    assert "LoRA:" in proc.stdout and "tensorboard --logdir" in proc.stdout


def test_lora_file_has_sd_scripts_keys(trained):
    from safetensors import safe_open

    run_dir = trained.run_dir
    final = run_dir / "tiny.safetensors"
    assert final.is_file(), sorted(p.name for p in run_dir.iterdir())
    with safe_open(str(final), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    assert any(k.endswith("lora_down.weight") for k in keys) and any(k.endswith(".alpha") for k in keys)
    assert any("double_blocks_0" in k for k in keys) and any("single_blocks_0" in k for k in keys)


def test_lora_metadata_names_the_base_model_by_its_sha256(trained):
    """sd-scripts' digest of the base model, which the runner keeps per file (file_hash) instead of reading the
    model again at every start: the metadata holds the file's real sha256, and so does the cache."""
    import hashlib
    import json

    import tomli
    from safetensors import safe_open

    from flux_trainer.sdscripts import file_hash

    model = tomli.loads((trained.run_dir / "sd_scripts.toml").read_text())["model"]["pretrained_model_name_or_path"]
    want = hashlib.sha256(open(model, "rb").read()).hexdigest()
    with safe_open(str(trained.run_dir / "tiny.safetensors"), "pt") as f:
        assert f.metadata()["ss_new_sd_model_hash"] == want
    kept = json.loads((trained.cache / file_hash.CACHE_FILE).read_text())
    assert kept[file_hash.file_key(os.stat(model), model)] == want


def test_tensorboard_events_hold_loss_metrics_and_config(trained):
    from flux_trainer.metrics.tensorboard import read_scalars, read_texts

    run_dir = trained.run_dir
    event_dirs = {p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")}
    assert event_dirs, "no TensorBoard events"
    scalars, texts = {}, {}
    for d in event_dirs:
        scalars.update(read_scalars(d))
        texts.update(read_texts(d))
    assert [s for s, _ in scalars["loss/current"]] == [1, 2]
    assert all(v == v for _, v in scalars["loss/current"])  # finite, not NaN
    assert "time/step_s" in scalars and scalars["time/step_s"][-1][1] > 0
    assert "vram/peak_gib" in scalars  # 0.0 on CPU: there is no device memory to read
    assert "host/ram_gib" in scalars and scalars["host/ram_gib"][-1][1] > 0.1
    assert any("config" in t for t in texts) and "tiny" in texts["run/config"]
    assert "accelerate.commands.launch" in texts["run/command"] and texts["run/kernels"]
    # one process: started directly with accelerate's environment (launcher.direct), which command.txt says
    assert "# launcher.direct: the same process started as " in texts["run/command"]
    assert "-m flux_trainer.sdscripts.runner --run-dir" in texts["run/command"].splitlines()[-1]
    assert "without its launcher (launcher.direct)" in (trained.run_dir / "train.log").read_text()
    # kernels=auto on a CPU installs the plain-PyTorch kernels: the per-step embeddings without syncs, the LoRA norms
    # (sd-scripts' grad-norm tag comes from them), Prodigy's step (the default optimizer) and, on this one process,
    # no gradient all-reduce
    assert texts["run/kernels"] == "flux_prologue, lora_grad_norms, prodigy_step, single_process_reduce"
    assert "flux_kernels installed flux_prologue:" in (run_dir / "train.log").read_text()
    assert "flux_kernels installed single_process_reduce" in (run_dir / "train.log").read_text()
    # train.sync_free (the default): sd-scripts' grad-norm mean is logged from its host copy, under its own step
    assert [s for s, _ in scalars["norm/avg_grad_norm"]] == [1, 2]
    assert all(v > 0 for _, v in scalars["norm/avg_grad_norm"])
    assert "sync-free steps: the loss read from a" in (run_dir / "train.log").read_text()
    assert "lora_grad_norms: 13 LoRA modules" in " ".join((run_dir / "train.log").read_text().split())
    # where the start-up went, from the command to the first step's end: the phases that take time even with the tiny
    # model (the line leaves out those under 0.05 s), in their order
    startup = texts["run/startup"]
    phases = ["flux-train", "imports", "caches", "first step"]
    at = [startup.find(f" {p} ") for p in phases]
    assert startup.startswith("start-up ") and -1 not in at and at == sorted(at), startup
    assert " ".join(startup.split()[:4]) in " ".join((run_dir / "train.log").read_text().split())  # wrapped by rich
    total = float(startup.split()[1])
    assert [s for s, _ in scalars["time/startup_s"]] == [1] and scalars["time/startup_s"][0][1] == pytest.approx(
        total, abs=0.06
    )
    assert 1.0 < total < 600


def test_profile_written_when_the_run_ends_inside_its_window(trained):
    import gzip
    import json

    from flux_trainer.metrics.tensorboard import read_texts

    profile = trained.run_dir / "profile"
    summary = (profile / "summary.txt").read_text()
    assert summary.startswith("profiled 1 step(s)") and "top CPU ops" in summary
    assert json.loads((profile / "summary.json").read_text())["steps"] == 1
    trace = json.load(gzip.open(profile / "trace-rank0.json.gz"))
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    texts = {}
    for d in {p.parent for p in (trained.run_dir / "tb").rglob("events.out.tfevents.*")}:
        texts.update(read_texts(d))
    assert texts["run/profile"].startswith("profiled 1 step(s)")


def test_memory_snapshot_on_a_cpu_run_says_it_records_nothing(trained):
    log = " ".join((trained.run_dir / "train.log").read_text().split())
    assert "logging.memory_snapshot_at:" in log and "device; no memory snapshot" in log  # wrapped by rich
    assert not (trained.run_dir / "memory").exists()


def test_samples_and_hparams_in_tensorboard(trained):
    from flux_trainer.metrics.tensorboard import read_hparams, read_images

    run_dir = trained.run_dir
    assert sorted((run_dir / "sample").glob("*.png")), "sd-scripts rendered no sample"
    images, hparams = {}, {}
    for d in {p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")}:
        images.update(read_images(d))
        hparams.update(read_hparams(d))
    (tag,) = images
    assert tag.startswith("samples/") and images[tag][0] == (2, 64, 64)
    assert hparams["network.rank"] == 16 and hparams["dataset.resolution"] == 128


def test_saved_state_allows_resume(trained):
    from flux_trainer.sdscripts.resume import newest_state

    run_dir = trained.run_dir
    state = newest_state(run_dir.parent.parent, "tiny")
    assert state is not None and state.step == 2


def test_resume_auto_continues_then_says_finished(trained):
    runs_root = trained.run_dir.parent
    more = trained.rerun("resume=auto", "train.max_steps=3")
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "continuing 'tiny' from step 2" in more.stdout
    newest = sorted(p for p in runs_root.iterdir() if p.is_dir())[-1]
    assert '"current_step": 3' in (newest / "tiny-state" / "train_state.json").read_text()
    before = sorted(runs_root.iterdir())
    done = trained.rerun("resume=auto", "train.max_steps=3")
    assert done.returncode == 0 and "already finished" in done.stdout
    assert sorted(runs_root.iterdir()) == before  # nothing new written


def test_runs_listing_reads_the_events(trained, capsys):
    from flux_trainer.commands.runs import runs_command

    root = trained.run_dir.parent.parent
    assert runs_command(root) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if trained.run_dir.name in ln)
    fields = line.split()
    assert fields[1:3] == ["done", "2"] and float(fields[3]) > 0  # status, steps done, last loss
    assert fields[-1] == "s" and 1.0 < float(fields[-2]) < 600  # the start-up, command to the first step's end


def test_same_seed_same_losses_whether_or_not_the_run_built_the_caches(trained):
    """The first run built the latent and text-encoder caches (the VAE draws random numbers for that); a second run
    with the same seed reuses them and must still see the same LoRA init, data and noise: the same losses."""

    from flux_trainer.sdscripts import file_hash

    hashes = trained.cache / file_hash.CACHE_FILE
    before = hashes.stat().st_mtime_ns if hashes.exists() else None
    proc = trained.rerun("train.output_name=again", "train.save_every_n_steps=null", "sample.prompts=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = sorted((trained.run_dir.parent.parent / "again").glob("*"))[-1]
    log, first_log = (again / "train.log").read_text(), (trained.run_dir / "train.log").read_text()
    assert "random state put back to before" in log  # (sd-scripts' rich handler wraps the rest)
    # every text-encoder output on disk and no sample prompt: sd-scripts' model moves skipped (te_cache); the first
    # run built the caches (and had a sample prompt to encode), so it went sd-scripts' own way
    skipped = "text-encoder outputs: every one on"  # the log line's start (sd-scripts' rich handler wraps the rest)
    assert skipped in log and skipped not in first_log
    assert before is not None and hashes.stat().st_mtime_ns == before  # the model's sha256 taken from the cache
    first, second = losses(trained.run_dir), losses(again)
    assert len(first) == len(second) == 2
    assert second == pytest.approx(first, rel=1e-6)


def test_prodigy_step_kernel_trains_like_prodigyopt(trained):
    """The run above had prodigy_step (kernels=auto, the default optimizer Prodigy); the same run with prodigyopt's own
    step (auto's other kernel named alone) gives the same losses and the same LoRA after the same steps."""
    from safetensors.torch import load_file

    from flux_trainer.metrics.tensorboard import read_texts

    proc = trained.rerun(
        "train.output_name=plainprodigy",
        "train.save_every_n_steps=null",
        "sample.prompts=[]",
        "kernels.set=lora_grad_norms",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = sorted((trained.run_dir.parent.parent / "plainprodigy").glob("*"))[-1]
    events = next((run / "tb").rglob("events.out.tfevents.*")).parent
    assert read_texts(events)["run/kernels"] == "lora_grad_norms"
    assert losses(run) == pytest.approx(losses(trained.run_dir), rel=1e-5)
    want, got = load_file(trained.run_dir / "tiny.safetensors"), load_file(run / "plainprodigy.safetensors")
    assert want.keys() == got.keys()
    for key, w in want.items():
        w, g = w.float(), got[key].float()
        assert ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() <= 1e-4, key
