"""activation_offload: a checkpointed block's saved tensors through host memory and back, bit-exact.

On the CPU the "host" copies are plain CPU copies without streams: what these tests check is which tensors go,
that each comes back to the slot it left and with its strides, the group chain that reloads one block ahead, and
that sd-scripts' compiled blocks give the same gradients with it. The streams and page-locked memory are checked by
the registry probe and tests/gpu on a GPU."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch

from flux_kernels.memory import activation_offload as ao
from flux_kernels.memory import selective_checkpoint as sac
from flux_kernels.patches import compile_blocks
from flux_kernels.runtime import registry
from flux_kernels.runtime.errors import KernelError
from tests.conftest import tiny_flux, tiny_flux_forward, undoing


def test_the_probe_pair_agrees_and_auto_leaves_it_out():
    spec = registry.REGISTRY["activation_offload"]
    assert registry.probe(spec, "cpu").ok
    assert not spec.in_auto
    assert "activation_offload" not in registry.select("auto", "cpu").installed
    with pytest.raises(KernelError, match="cannot run on"):
        registry.select("activation_offload", "cpu")  # named on a CPU: an error naming why


def test_a_broken_reload_is_rejected_by_the_probe(monkeypatch):
    """The probe is what stands between a wrong copy and training: slots swapped on reload must fail it."""
    original = ao.Offloader._reload

    def swapped(self, g):
        original(self, g)
        if len(g.back) > 1:
            g.back[0], g.back[-1] = g.back[-1], g.back[0]

    monkeypatch.setattr(ao.Offloader, "_reload", swapped)
    spec = registry.REGISTRY["activation_offload"]
    result = registry.probe(spec, "cpu")
    assert not result.ok, result


def _random(*shape):
    return torch.randn(*shape) + 0.5


def test_what_goes_to_the_host_and_what_stays():
    weight = torch.nn.Parameter(_random(64, 64))
    model = torch.nn.Linear(64, 64)
    off = ao.Offloader(model, min_bytes=1024)
    with off.group(torch.device("cpu")):
        pass  # a new forward: the model's storages are counted frozen
    big, small = _random(16, 64), _random(4, 4)
    assert off.offloads(big)
    assert not off.offloads(small)  # under min_bytes
    assert not off.offloads(weight)  # a parameter
    assert not off.offloads(model.weight.t())  # a view of a model's weight: same storage
    assert not off.offloads(_random(16, 128)[:, ::2])  # not dense
    assert off.offloads(_random(64, 16).t())  # dense, transposed: comes back with its strides


def test_views_with_gaps_go_when_asked_packed_on_the_host_and_back_at_their_strides():
    """FLUX_KERNELS_OFFLOAD_VIEWS=1: a view with gaps (lora_fold's blocks save views of its concatenated input) goes
    too: its elements only on the host, back into a buffer of its own strides; overlapping views never go."""
    base = _random(16, 131)
    gapped = base[:, 3:67]  # rows 131 apart: 64 of each row's 131 elements
    assert not ao.Offloader(min_bytes=0).offloads(gapped)
    off = ao.Offloader(min_bytes=0, views=True)
    assert off.offloads(gapped) and off.offloads(base[:, ::2])
    assert not off.offloads(_random(1, 64).expand(16, 64))  # overlapping: one row 16 times
    cpu = torch.device("cpu")
    dense_t = _random(16, 8).t()
    with off.group(cpu):
        pg, pd = off.pack(off._last(), gapped), off.pack(off._last(), dense_t)
    host = off._last().host
    assert host[0].is_contiguous() and host[0].untyped_storage().nbytes() == gapped.numel() * 4  # no gaps copied
    got_g, got_d = off.unpack(pg), off.unpack(pd)
    for got, want in ((got_g, gapped), (got_d, dense_t)):
        assert torch.equal(got, want) and got.stride() == want.stride() and got.data_ptr() != want.data_ptr()


def test_install_takes_views_as_asked_and_the_environment_wins_where_set(fm, monkeypatch):
    """`views` (kernels.offload_views) unless FLUX_KERNELS_OFFLOAD_VIEWS is set and not empty."""
    for env, asked, want in (("", False, False), ("", True, True), ("1", False, True), ("0", True, False)):
        monkeypatch.setenv(ao.VIEWS_ENV, env)
        model = tiny_flux(fm)
        for b in model.double_blocks + model.single_blocks:
            b._compiled_call_impl = b._call_impl  # stands in for compile_blocks (install only checks it is there)
        line = ao.install(model, views=asked)
        assert ao.offloader_of(model).views is want and ("views with gaps" in line) is want, (env, asked)


def test_each_tensor_comes_back_to_its_slot_with_its_strides_and_the_earlier_group_is_prefetched():
    off = ao.Offloader(min_bytes=0)
    cpu = torch.device("cpu")
    a, b, c = _random(8, 16), _random(16, 8).t(), _random(3, 5)
    with off.group(cpu):
        pa, pb = off.pack(off._last(), a), off.pack(off._last(), b)
    with off.group(cpu):
        pc = off.pack(off._last(), c)
    assert off.step_tensors == 3 and off.step_bytes == sum(t.numel() * 4 for t in (a, b, c))
    assert pc.group.prev() is pa.group and pa.group.prev() is None
    got_c = off.unpack(pc)  # backward: the last group first, which starts the one before it
    assert pa.group.loading
    got_b, got_a = off.unpack(pb), off.unpack(pa)
    for got, want in ((got_a, a), (got_b, b), (got_c, c)):
        assert torch.equal(got, want) and got.stride() == want.stride()
        assert got.data_ptr() != want.data_ptr()  # a copy back, not the original
    assert sum(len(v) for v in off.pool.values()) == 3  # every host buffer free for the next step
    with off.group(cpu):  # the next forward: a new chain, the buffers reused
        pa2 = off.pack(off._last(), _random(8, 16))
    assert pa2.group.prev() is None and off.step_tensors == 1
    assert sum(len(v) for v in off.pool.values()) == 2


class _Stream:
    """A CUDA stream stand-in that records what it was made to wait for."""

    def __init__(self, name: str, waits: list):
        self.name, self.waits = name, waits

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        self.waits.append((self.name, event))


class _Event:
    def record(self, stream) -> None:
        self.stream = stream


def test_with_cuda_graphs_a_groups_gpu_tensors_live_until_the_compute_stream_waited_for_their_copies(monkeypatch):
    """The stream logic of `hold` (CUDA graphs) on CPU stand-ins: a group's GPU tensors outlive HOLD more block
    calls, the compute stream waits for that group's copies to the host before they are dropped, backward drops
    what is still held before its first reload, and the reloads reuse RING sets of buffers."""
    waits = []
    compute = _Stream("compute", waits)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    off = ao.Offloader(min_bytes=0, hold=2)
    streams = (_Stream("to host", waits), _Stream("back", waits))
    monkeypatch.setattr(off, "_streams_of", lambda device: streams)
    cpu = torch.device("cpu")
    addresses = []
    for step in range(2):
        waits.clear()
        values, alive, packed = [], [], []
        for _ in range(4):
            t = _random(8, 16)
            values.append(t.clone())
            with off.group(cpu):
                packed.append(off.pack(off._last(), t))
            alive.append(weakref.ref(t))
            del t
        groups = [p.group for p in packed]
        # the fourth call dropped the first group's tensors, after the compute stream waited for its copies
        assert [a() is not None for a in alive] == [False, True, True, True]
        assert [w for w in waits if w[0] == "compute"] == [("compute", groups[0].saved)]
        got = off.unpack(packed[3])  # backward: the rest dropped first, each after its copies
        assert all(a() is None for a in alive)
        assert [w for w in waits if w[0] == "compute"][1:4] == [("compute", g.saved) for g in groups[1:]]
        assert ("back", groups[3].saved) in waits  # the reload itself waits for the copies too
        addresses.append([got.data_ptr()])
        assert torch.equal(got, values[3])
        for i in (2, 1, 0):
            got = off.unpack(packed[i])
            assert torch.equal(got, values[i])
            addresses[step].insert(0, got.data_ptr())
    # the reloads land in the same buffers every step (the backward graphs' fixed addresses), two sets in turn
    assert addresses[0] == addresses[1]
    assert addresses[0][0] == addresses[0][2] != addresses[0][1] == addresses[0][3]


def test_without_cuda_graphs_nothing_is_held(monkeypatch):
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append(stream))
    off = ao.Offloader(min_bytes=0)
    waits = []
    monkeypatch.setattr(off, "_streams_of", lambda device: (_Stream("to host", waits), _Stream("back", waits)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream("compute", waits))
    t = _random(8, 16)
    with off.group(torch.device("cpu")):
        off.pack(off._last(), t)
    alive = weakref.ref(t)
    del t
    assert alive() is None  # the allocator, told by record_stream, keeps the memory until the copy is done
    assert [s.name for s in recorded] == ["to host"]
    assert not any(name == "compute" for name, _ in waits)


def _model(fm, offload: bool, keep_last: int = 0):
    model = tiny_flux(fm).train()
    model.enable_gradient_checkpointing()
    sac.install(model)
    compile_blocks.install(model)
    if offload:
        assert "2 blocks" in ao.install(model, min_bytes=0, keep_last=keep_last)
    return model


def _grads(model):
    torch.manual_seed(0)  # tiny_flux_forward's timestep comes from the global generator
    out = tiny_flux_forward(model, img_tokens=64, txt_tokens=16)
    params = [p for p in model.parameters() if p.requires_grad]
    return [out.detach(), *torch.autograd.grad(out.square().mean(), params)]


def test_sd_scripts_compiled_blocks_give_the_same_gradients_with_their_saved_tensors_offloaded(
    fm, tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    plain = _model(fm, offload=False)
    made = [plain]

    def remove_kernels():
        for m in made:
            sac.remove(m)
            ao.remove(m)
            compile_blocks.remove(m)

    with undoing(remove_kernels, torch._dynamo.reset):
        want = _grads(plain)
        model = _model(fm, offload=True)
        made.append(model)
        off = ao.offloader_of(model)
        packed = []
        monkeypatch.setattr(off, "pack", lambda g, t, pack=off.pack: packed.append(r := pack(g, t)) or r)
        got = _grads(model)
        again = _grads(model)  # a second step reuses the host buffers
    assert len(got) == len(want) > 40
    for g, g2, w in zip(got, again, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g2, w, rtol=1e-5, atol=1e-6)
    offloaded = [p for p in packed if isinstance(p, ao.Packed)]
    groups = {id(p.group) for p in offloaded}
    assert len(groups) == 4  # both blocks, both steps: the compiled blocks' saved tensors pass through the hooks
    assert off.step_tensors >= 4 and off.host_bytes > 0
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = [p for p in packed if isinstance(p, torch.Tensor)]
    assert any(k.untyped_storage().data_ptr() in weights for k in kept)  # the weights were saved, and stayed


def test_the_last_checkpointed_block_keeps_its_tensors_and_unchecked_blocks_are_left_alone(fm, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = _model(fm, offload=True, keep_last=1)
    off = ao.offloader_of(model)
    with undoing(
        lambda: sac.remove(model), lambda: ao.remove(model), lambda: compile_blocks.remove(model), torch._dynamo.reset
    ):
        _grads(model)
        one_block = off.step_tensors
        model.single_blocks[0].gradient_checkpointing = False  # the double block is now the last checkpointed one
        _grads(model)
        none = off.step_tensors
    assert one_block > 0
    assert none == 0


def test_with_cuda_graphs_more_is_offloaded_by_default_and_the_env_overrides_either(fm, monkeypatch):
    """Measured per mode (H200): under graphs, keeping blocks bought nothing and 1 MiB tensors are worth copying."""
    model = tiny_flux(fm)
    for b in model.double_blocks + model.single_blocks:
        b._compiled_call_impl = b._call_impl  # stands in for compile_blocks (install only checks it is there)
    for graphs, keep, mib, hold in ((False, ao.KEEP_LAST, 4, 0), (True, ao.KEEP_LAST_GRAPHS, 1, ao.HOLD)):
        line = ao.install(model, graphs=graphs)
        off = ao.offloader_of(model)
        assert (off.keep_last, off.min_bytes, off.hold) == (keep, mib * 2**20, hold)
        assert f">= {mib:g} MiB" in line and f"not the last {keep}" in line
        assert ("CUDA graphs" in line) is graphs
    monkeypatch.setenv(ao.KEEP_LAST_ENV, "3")
    monkeypatch.setenv(ao.MIN_BYTES_ENV, "0.5")
    ao.install(model, graphs=True)
    assert (ao.offloader_of(model).keep_last, ao.offloader_of(model).min_bytes) == (3, 2**19)
    assert ao.remove(model)


def test_install_needs_compiled_blocks_and_refuses_block_swap(fm):
    model = tiny_flux(fm)
    with pytest.raises(KernelError, match="needs compile_blocks"):
        ao.install(model)
    model.blocks_to_swap = 2
    with pytest.raises(KernelError, match="block swap"):
        ao.install(model)


def test_the_run_logs_what_a_step_offloads_and_tensorboard_gets_it_every_step(tmp_path, caplog):
    import logging

    from flux_trainer.metrics.health import LossGuard, SlowdownDetector
    from flux_trainer.metrics.step import StepMetrics
    from flux_trainer.sdscripts.hooks import OFFLOAD_REPORTED_AT, RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    model = torch.nn.Linear(4, 4)
    off = ao.Offloader(model, min_bytes=0)
    model.__dict__[ao.ATTR] = off
    with off.group(torch.device("cpu")):
        off.pack(off._last(), _random(256, 1024))  # 1 MiB
    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    h._unet, h.kernels_installed = model, ["compile_blocks", "activation_offload"]
    h.metrics = StepMetrics("cpu", flops_per_step=1e12, images_per_step=1, nvml=None)
    h.metrics.start()
    h.loss_guard, h.slowdown = LossGuard(patience=3), SlowdownDetector(nvml=None)
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):
        h.step_start()
        assert h.step_end(None, {}, 1)["memory/offloaded_gib"] == pytest.approx(1 / 1024)
        assert "activation_offload" not in caplog.text
        h.step_end(None, {}, OFFLOAD_REPORTED_AT)
    assert "activation_offload: 1 saved tensors, 0.00 GiB a step to host memory and back (0.00 GiB" in caplog.text
    h.kernels_installed = ["compile_blocks"]
    assert "memory/offloaded_gib" not in h.step_end(None, {}, 3)
