"""model_copy (train.staged_copy): the base model moved through staging buffers on several threads ends up
exactly as Module.to leaves it. On the CPU the copies go host to host (no CUDA), through the same slicing, threads
and swap; tests/gpu/test_model_copy_gpu.py runs the pinned path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flux_trainer.sdscripts import model_copy


def model() -> torch.nn.Module:
    gen = torch.Generator().manual_seed(3)
    m = torch.nn.Module()
    m.big = torch.nn.Linear(700, 600).to(torch.bfloat16)  # 0.84 MB weight: over the threshold below
    m.wide = torch.nn.Linear(300, 1000)  # fp32, 1.2 MB
    m.small = torch.nn.Linear(4, 3)  # under the threshold: the plain way
    m.tied = torch.nn.Module()
    m.tied.weight = m.wide.weight  # one tensor reached through two modules
    m.register_buffer("table", torch.randn(257, 1031, generator=gen))  # odd sizes: slices end mid-tensor
    m.register_buffer("strided", torch.randn(800, 400, generator=gen).t())  # non-contiguous: the plain way
    m.fp8 = torch.nn.Linear(1024, 640, bias=False)
    m.fp8.weight.requires_grad_(False)
    m.fp8.weight.data = torch.randn(640, 1024, generator=gen).to(torch.float8_e4m3fn)
    for p in m.parameters():
        if p.dtype != torch.float8_e4m3fn:
            p.data.normal_(generator=gen)
    return m


def snapshot(m: torch.nn.Module) -> dict[str, tuple]:
    out = {}
    for name, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]:
        out[name] = (
            t.dtype,
            tuple(t.shape),
            t.stride(),
            t.requires_grad,
            model_copy._bytes(t.detach().contiguous()).clone(),
        )
    return out


@pytest.mark.parametrize("threads", [1, 3])
def test_staged_copy_leaves_what_module_to_leaves(monkeypatch, threads):
    monkeypatch.setattr(model_copy, "MIN_TENSOR_BYTES", 500_000)
    m = model()
    before = snapshot(m)
    params = dict(m.named_parameters(remove_duplicate=False))
    pointers = {n: t.data_ptr() for n, t in [*params.items(), *m.named_buffers()]}
    report = model_copy.staged_copy(m, "cpu", threads=threads, chunk=100_003)  # slices end mid-element too
    after = snapshot(m)
    assert after.keys() == before.keys()
    for name, (dtype, shape, stride, grad, data) in before.items():
        assert after[name][:4] == (dtype, shape, stride, grad), name
        assert torch.equal(after[name][4], data), name
    # the same Parameter objects, still shared where they were
    assert all(p is params[n] for n, p in m.named_parameters(remove_duplicate=False))
    assert m.tied.weight is m.wide.weight
    moved = {
        n for n, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()] if t.data_ptr() != pointers[n]
    }
    assert moved == {"big.weight", "wide.weight", "tied.weight", "table", "fp8.weight"}  # new storage: really copied
    assert report.tensors == 4 and report.threads == threads and not report.pinned
    assert report.bytes == 600 * 700 * 2 + 1000 * 300 * 4 + 257 * 1031 * 4 + 640 * 1024


def test_nothing_on_the_host_is_no_move():
    m = torch.nn.Module()
    m.register_buffer("t", torch.zeros(3, device="meta"))
    assert model_copy.staged_copy(m, "cpu", threads=2) is None


def test_pieces_cover_every_byte_once():
    a, b = torch.arange(1000, dtype=torch.int32), torch.arange(77, dtype=torch.int16)
    targets = {id(a): torch.empty_like(a), id(b): torch.empty_like(b)}
    work = model_copy.pieces([b, a], targets, chunk=512)
    assert [s.numel() for s, _ in work] == [512] * 7 + [4000 - 7 * 512, 154]  # the largest tensor first
    for src, dst in work:
        dst.copy_(src)
    assert torch.equal(targets[id(a)], a) and torch.equal(targets[id(b)], b)


def test_a_failing_copy_is_raised(monkeypatch):
    m = model()

    def broken(*a, **k):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(model_copy, "_bytes", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        model_copy.staged_copy(m, "cpu", threads=2)


@pytest.mark.parametrize(
    "kind, placement, device, moves",
    [
        ("NO", True, "cuda", True),
        ("MULTI_GPU", True, "cuda", True),
        ("FSDP", True, "cuda", False),
        ("DEEPSPEED", True, "cuda", False),
        ("NO", False, "cuda", False),
        ("NO", True, "cpu", False),
    ],
)
def test_moves_whole_model(kind, placement, device, moves):
    from accelerate.utils import DistributedType

    acc = SimpleNamespace(
        device=torch.device(device), device_placement=placement, distributed_type=DistributedType(kind)
    )
    assert model_copy.moves_whole_model(acc) is moves


def test_hook_moves_only_where_accelerate_would(monkeypatch, tmp_path):
    from flux_trainer.sdscripts.hooks import RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    calls = []
    monkeypatch.setattr(model_copy, "staged_copy", lambda m, d, threads: calls.append((m, d)))  # returns None
    cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"), device_placement=True, distributed_type=None)
    spec = RunnerSpec(sd_scripts="", train_toml="", dataset_toml="")
    h = RunHooks(spec, tmp_path)
    h.model_to_device("unet", SimpleNamespace(device=torch.device("cpu")))
    assert calls == []
    h.model_to_device("unet", cuda)
    assert calls == [("unet", cuda.device)] and h.startup.phases()[-1][0] == "model to the device"
    spec.staged_copy = False
    h.model_to_device("unet", cuda)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "swapping, first, want",
    [
        (False, True, ["move+network", "kernels", "accelerate"]),  # the kernels install on the GPU
        (False, False, ["move+network", "kernels", "move", "accelerate"]),  # not there first: after the kernels
        (True, True, ["kernels", "accelerate"]),  # block swap: sd-scripts places the blocks
    ],
)
def test_the_runner_moves_the_model_before_accelerate_unless_blocks_swap(monkeypatch, tmp_path, swapping, first, want):
    """Through the runner's trainer class on sd-scripts' own FluxNetworkTrainer (its prepare replaced by a
    recorder): our move comes first (with the LoRA, before the kernels where it can), then sd-scripts' prepare."""
    from flux_trainer.sdscripts import checkout as sd_checkout
    from flux_trainer.sdscripts import runner
    from flux_trainer.sdscripts.hooks import RunHooks

    try:
        mods = sd_checkout.import_sd_scripts(sd_checkout.locate(None).path)
    except Exception as e:  # noqa: BLE001 - not found, or not importable here
        pytest.skip(f"sd-scripts not importable: {e}")
    order = []

    def move(self, unet, acc, with_network=False):
        order.append("move+network" if with_network else "move")
        return first

    monkeypatch.setattr(RunHooks, "before_prepare", lambda self, unet, args, acc: order.append("kernels"))
    monkeypatch.setattr(RunHooks, "model_to_device", move)
    monkeypatch.setattr(
        mods.flux_train_network.FluxNetworkTrainer,
        "prepare_unet_with_accelerator",
        lambda self, args, acc, unet: order.append("accelerate") or unet,
    )
    trainer = runner.make_trainer_class(
        mods, runner.RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path
    )()
    trainer.is_swapping_blocks = swapping
    assert trainer.prepare_unet_with_accelerator(SimpleNamespace(), None, "unet") == "unet"
    assert order == want


class Lora(torch.nn.Module):
    """sd-scripts' LoRAModule's shape of attachment: it replaces the Linear's forward and is not its child."""

    def __init__(self, linear: torch.nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.lora_down = torch.nn.Linear(linear.in_features, rank, bias=False)
        self.lora_up = torch.nn.Linear(rank, linear.out_features, bias=False)
        self.register_buffer("alpha", torch.tensor(4.0))
        self.org_forward = linear.forward
        linear.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + self.lora_up(self.lora_down(x))


def test_attached_modules_are_the_lora():
    m = model()
    loras = [Lora(m.big), Lora(m.wide)]
    found = model_copy.attached_modules(m)
    assert len(found) == 2 and all(any(f is lo for f in found) for lo in loras)
    assert model_copy.attached_modules(model()) == []


@pytest.mark.parametrize("covered, fits, moves", [(True, True, True), (False, True, False), (True, False, False)])
def test_the_network_moves_with_the_model_where_it_holds_what_is_trained(monkeypatch, tmp_path, covered, fits, moves):
    """To the meta device (a CPU test of where every tensor ends up): the model and the LoRA attached to it; where
    the optimizer trains a parameter outside them (a text encoder's LoRA, say), or the model as it is would not fit
    the card's free memory, nothing moves before the kernels."""
    from flux_trainer.sdscripts import checkpoint_fit
    from flux_trainer.sdscripts.hooks import ROOM_FOR_MODEL, RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    monkeypatch.setattr(model_copy, "moves_whole_model", lambda acc: True)
    m = model()
    need = model_copy.host_bytes(m)
    assert need == sum(t.numel() * t.element_size() for t in model_copy.module_tensors(m))
    room = int(need / ROOM_FOR_MODEL) + 1 if fits else int(need / ROOM_FOR_MODEL) - 1
    held = 1 << 20  # the card: 1 MiB held by PyTorch, nothing outside it; the room is free memory less nothing
    card = SimpleNamespace(free_total=lambda: (room, 4 * room), reserved=lambda: held, allocated=lambda: held,
                           fraction=lambda: 1.0)  # fmt: skip
    monkeypatch.setattr(checkpoint_fit, "DeviceMemory", lambda device: card)
    loras = [Lora(m.big), Lora(m.fp8)]
    trained = [p for lo in loras for p in lo.parameters()] + ([] if covered else [torch.nn.Parameter(torch.ones(3))])
    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    h.optimizer_created(SimpleNamespace(param_groups=[{"params": trained}]))
    moved = h.model_to_device(m, SimpleNamespace(device=torch.device("meta")), with_network=True)
    tensors = [*m.parameters(), *m.buffers(), *(t for lo in loras for t in (*lo.parameters(), *lo.buffers()))]
    assert moved is moves
    assert {t.device.type for t in tensors} == ({"meta"} if moves else {"cpu"})
    if moves:
        assert h.startup.phases()[-1][0] == "model to the device"


def test_a_failed_copy_leaves_the_model_to_accelerate(monkeypatch, tmp_path, caplog):
    """Page-locked memory can be refused (some VMs, WSL): the model is left as it was, with one warning."""
    import logging

    from flux_trainer.sdscripts.hooks import RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    m = model()
    before = snapshot(m)
    pointers = [t.data_ptr() for t in m.parameters()]

    def refused(*a, **k):
        raise RuntimeError("CUDA error: out of memory (page-locked)")

    monkeypatch.setattr(model_copy, "moves_whole_model", lambda acc: True)
    monkeypatch.setattr(model_copy, "pieces", refused)  # fails inside the copy, after the targets exist
    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    with caplog.at_level(logging.WARNING, logger="flux_trainer.runner"):
        h.model_to_device(m, SimpleNamespace(device=torch.device("cpu")))
    assert [t.data_ptr() for t in m.parameters()] == pointers
    assert all(torch.equal(snapshot(m)[n][4], v[4]) for n, v in before.items())
    assert any("train.staged_copy failed (RuntimeError" in r.getMessage() for r in caplog.records)
    assert all(name != "model to the device" for name, _ in h.startup.phases())
