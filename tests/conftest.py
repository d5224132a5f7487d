"""Shared fixtures: a user's working directory with a dataset config, and composition like the CLI does."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from flux_trainer.config.compose import compose_run

pytest_plugins = ["pytester", "tests.torch_config_guard"]  # a test leaving torch's config changed fails (see there)


@contextlib.contextmanager
def undoing(*undo):
    """Run each of `undo` (callables, in order) when the block ends, however it ends, where tests would write
    `try: ... finally: ...`. A `finally:` that fails replaces the test's own failure with its own; here the block's
    failure is the one raised, with any failed undo added to it as a note. Every undo runs even if one fails; with
    no failure in the block, the first failed undo is raised."""
    failed: list[BaseException] = []
    try:
        yield
    except BaseException as exc:
        for fn in undo:
            try:
                fn()
            except Exception as cleanup:  # noqa: BLE001 - told with the test's own failure, never instead of it
                if hasattr(exc, "add_note"):
                    exc.add_note(f"and undoing with {getattr(fn, '__name__', fn)!s} failed too: {cleanup!r}")
        raise
    for fn in undo:
        try:
            fn()
        except Exception as cleanup:  # noqa: BLE001 - the rest still run; the first is raised below
            failed.append(cleanup)
    if failed:
        raise failed[0]


def make_images(folder: Path, n: int = 3, captions: bool = True, size=(96, 64)) -> Path:
    """n flat-colour images (a list of sizes is cycled through: several aspect-ratio buckets), captioned or not."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = size if isinstance(size, list) else [size]
    for i in range(n):
        Image.new("RGB", sizes[i % len(sizes)], (30 * i, 120, 200 - 20 * i)).save(folder / f"img{i}.png")
        if captions:
            (folder / f"img{i}.txt").write_text(f"a test image number {i}")
    return folder


def write_dataset(config_dir: Path, name: str, images: Path | str, **fields) -> Path:
    import json

    path = config_dir / "dataset" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"name": name, "images": str(images), **fields}
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in body.items()) + "\n")
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A user's working directory: ./configs/dataset/mychar.yaml over 3 captioned images; cwd is there. flux-train's
    cache is ./cache (the sd-scripts checkout it would have found stays named by FLUX_TRAIN_SD_SCRIPTS); no -v left
    on by another test."""
    from flux_trainer.sdscripts.checkout import locate

    images = make_images(tmp_path / "pics" / "mychar")
    write_dataset(tmp_path / "configs", "mychar", images, trigger="ohwx", resolution=512)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLUX_TRAIN_CONFIG_DIR", raising=False)
    monkeypatch.delenv("FLUX_TRAIN_VERBOSE", raising=False)
    try:
        monkeypatch.setenv("FLUX_TRAIN_SD_SCRIPTS", str(locate().path))
    except Exception:  # noqa: BLE001 - none here: the tests that need one skip
        pass
    monkeypatch.setenv("FLUX_TRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture
def compose(workdir):
    def _compose(*overrides: str):
        return compose_run(list(overrides), [workdir / "configs"])

    return _compose


@pytest.fixture
def torch_config():
    """Set torch.compile's options (inductor's, functorch's config modules) for one test through their own
    `patch()`, undone at teardown: `torch_config(torch._inductor.config, fx_graph_cache=True)`. (With pytest's
    monkeypatch.setattr instead, torch 2.11's inductor config said "fx_graph_cache does not exist" after the test,
    and every later compile in the session failed; seen on the H200.)"""
    with contextlib.ExitStack() as stack:
        yield lambda module, **values: stack.enter_context(module.patch(**values))


@pytest.fixture(scope="session")
def fm():
    """sd-scripts' `library.flux_models`, from the checkout flux-train would use; skipped with the reason if none."""
    from flux_trainer.sdscripts.checkout import import_sd_scripts, locate

    try:
        return import_sd_scripts(locate().path).flux_models
    except Exception as e:  # noqa: BLE001 - not found, or not importable here: either way the test cannot run
        pytest.skip(f"sd-scripts not importable: {e}")


@pytest.fixture(scope="session")
def lora_flux(fm):
    """sd-scripts' `networks.lora_flux` (LoRAModule, LoRANetwork), from the same checkout as `fm`."""
    import importlib

    return importlib.import_module("networks.lora_flux")


def probe_with_broken_launcher(monkeypatch, kernel: str, launcher: str, broken):
    """The registry probe of `kernel` on the CPU through Triton's interpreter: it passes as installed, then runs again
    with flux_kernels.ops._launch's `launcher` replaced by broken(original); returns that second verdict (skips without
    triton)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from flux_kernels.ops import fast
    from flux_kernels.runtime import registry

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = registry.REGISTRY[kernel]
    assert registry.probe(spec, "cpu").ok
    launchers, _ = fast._ops_lib()
    monkeypatch.setattr(launchers, launcher, broken(getattr(launchers, launcher)))
    return registry.probe(spec, "cpu")


def cpu_row_scales() -> bool:
    """Whether this torch's CPU _scaled_mm takes one scale per row (torch 2.11's takes per-tensor scales only): the
    fp8 path's CPU tests need it."""
    import torch

    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def flux_block_pair(fm, hidden: int, heads: int, std: float):
    """One sd-scripts DoubleStreamBlock + one SingleStreamBlock with seeded random (never zero) weights, frozen."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.double_blocks = torch.nn.ModuleList([fm.DoubleStreamBlock(hidden, heads, 4.0, qkv_bias=True)])
    model.single_blocks = torch.nn.ModuleList([fm.SingleStreamBlock(hidden, heads, 4.0)])
    for name, p in model.named_parameters():
        p.data = (1 + 0.1 * torch.randn_like(p)) if name.endswith("scale") else std * torch.randn_like(p)
    return model


def tiny_flux(fm, **shapes):
    """sd-scripts' Flux at flux-train's `tiny` preset (with `shapes` overriding it), seeded random weights."""
    import dataclasses

    import torch

    from flux_trainer.config.random_specs import PRESETS

    torch.manual_seed(0)
    return fm.Flux(dataclasses.replace(fm.configs["dev"].params, **{**PRESETS["tiny"]["flux"], **shapes}))


def tiny_flux_forward(
    model, img_tokens: int = 16, txt_tokens: int = 8, mask: bool = False, seed: int = 1, device: str = "cpu"
):
    """One call of a `tiny_flux` model on seeded random inputs (mask: an all-true T5 attention mask), made on the
    CPU from a generator of their own and moved to `device`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(1, img_tokens, 64, generator=g), torch.randn(1, txt_tokens, 64, generator=g)
    ids = torch.zeros(1, img_tokens, 3), torch.zeros(1, txt_tokens, 3)
    m = torch.ones(1, txt_tokens, dtype=torch.bool) if mask else None
    y, t, guidance = torch.randn(1, 64, generator=g), torch.rand(1, generator=g), torch.full((1,), 3.5)
    img, txt, y, t, guidance = (x.to(device) for x in (img, txt, y, t, guidance))
    ids = tuple(x.to(device) for x in ids)
    m = None if m is None else m.to(device)
    return model(img=img, img_ids=ids[0], txt=txt, txt_ids=ids[1], timesteps=t, y=y, guidance=guidance,
                 txt_attention_mask=m)  # fmt: skip


def two_processes(tmp_path: Path, script: str, *args: str) -> list:
    """Run `script` as two processes of one process group (torch.distributed's environment: WORLD_SIZE, RANK,
    MASTER_ADDR on loopback); each saves what it found to `sys.argv[1]/rank{RANK}.pt` (argv[2:] are `args`) and
    should destroy its process group before it exits.
    Returns the two results, rank 0's first, after asserting both processes succeeded."""
    import torch

    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(script))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(path), str(tmp_path), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]


TWO_PROCESS_REDUCE = """
    import importlib, sys
    import torch
    from accelerate import Accelerator
    from flux_kernels.ops import coalesced_reduce
    from flux_trainer.sdscripts.checkout import import_sd_scripts
    import_sd_scripts(sys.argv[2])  # as the runner imports it (its torchvision stand-in where there is none)
    train_network = importlib.import_module("train_network")
    acc = Accelerator(cpu=sys.argv[3] == "cpu")
    rank = acc.process_index
    gen = torch.Generator().manual_seed(rank)  # each process its own gradients
    net = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5, bias=False)).to(acc.device)
    for p in net.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * (rank + 1)).to(acc.device)
    grads = [p.grad.clone() for p in net.parameters()]
    trainer = train_network.NetworkTrainer()
    trainer.all_reduce_network(acc, net)  # sd-scripts' own: one accelerate reduce per tensor
    theirs = [p.grad.clone() for p in net.parameters()]
    for p, g in zip(net.parameters(), grads):
        p.grad = g.clone()
    coalesced_reduce.install(trainer)
    trainer.all_reduce_network(acc, net)
    ours = [p.grad for p in net.parameters()]
    cpu = lambda ts: [t.cpu() for t in ts]
    out = {"grads": cpu(grads), "theirs": cpu(theirs), "ours": cpu(ours), "type": str(acc.distributed_type)}
    torch.save(out, sys.argv[1] + f"/rank{rank}.pt")
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()  # the backend's threads stopped before exit (gloo can abort there)
"""


def check_two_process_reduce(tmp_path: Path, cuda: bool) -> None:
    """Two processes (gloo over loopback on the CPU, NCCL on two GPUs) with accelerate's Accelerator and sd-scripts'
    NetworkTrainer: sd-scripts' per-tensor all_reduce_network and coalesced_reduce's give the same gradients, bit
    for bit (a sum of two values does not depend on order), the mean of the two processes' gradients."""
    import torch

    from flux_trainer.sdscripts.checkout import locate

    r0, r1 = two_processes(tmp_path, TWO_PROCESS_REDUCE, str(locate().path), "cuda" if cuda else "cpu")
    assert r0["type"] == ("DistributedType.MULTI_GPU" if cuda else "DistributedType.MULTI_CPU")
    for g0, g1, t0, t1, o0, o1 in zip(*(r[k] for k in ("grads", "theirs", "ours") for r in (r0, r1)), strict=True):
        assert not torch.equal(g0, g1)
        assert torch.equal(t0, (g0 + g1) / 2) and torch.equal(t0, t1)
        assert torch.equal(o0, t0) and torch.equal(o1, t1)


def load_script(name: str):
    """scripts/NAME.py imported as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
