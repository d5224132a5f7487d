"""memory.checkpoint_skip (flux_trainer/sdscripts/checkpoint_fit.py): which blocks keep their activations.

CUDA's memory figures come from a fake here (the GPU run is in the README); the order, the fit, the fallbacks and,
with an sd-scripts checkout, gradients through sd-scripts' own blocks with some of them un-checkpointed."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from flux_trainer.config.validate import checkpoint_skip_setting
from flux_trainer.sdscripts.checkpoint_fit import (
    GIB,
    MARGIN,
    CheckpointFit,
    blocks_that_fit,
    room_bytes,
    skip_order,
    usable_bytes,
)


class Block(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.gradient_checkpointing = True

    def forward(self, x):
        return x + 1


def model(doubles: int = 3, singles: int = 4) -> nn.Module:
    m = nn.Module()
    m.double_blocks = nn.ModuleList([Block(f"d{i}") for i in range(doubles)])
    m.single_blocks = nn.ModuleList([Block(f"s{i}") for i in range(singles)])
    return m


class FakeMemory:
    """allocated() grows by `grow[kind]` across one forward of a block of that kind (the hooks read it around it)."""

    def __init__(self, grow: dict[str, int], peak: int, free: int, total: int, reserved: int, fraction: float = 1.0):
        self.grow, self.peak, self.free, self.total, self.res, self.frac = grow, peak, free, total, reserved, fraction
        self.now = 0
        self.fail = False

    def allocated(self) -> int:
        return self.now

    def peak_reserved(self) -> int:
        return self.peak

    def reserved(self) -> int:
        return self.res

    def free_total(self) -> tuple[int, int]:
        if self.fail:
            raise RuntimeError("no device")
        return self.free, self.total

    def fraction(self) -> float:
        return self.frac


def step(m: nn.Module, mem: FakeMemory) -> None:
    """One forward of every block, allocated memory growing by the block kind's activations as it runs."""
    for kind, blocks in (("double", m.double_blocks), ("single", m.single_blocks)):
        for b in blocks:
            b.register_forward_pre_hook(lambda *_, k=kind: setattr(mem, "now", mem.now + mem.grow[k]), prepend=False)
    x = torch.zeros(1)
    for b in list(m.double_blocks) + list(m.single_blocks):
        x = b(x)


def unchecked(m: nn.Module) -> list[str]:
    return [b.name for b in list(m.double_blocks) + list(m.single_blocks) if not b.gradient_checkpointing]


def test_order_is_the_two_measured_then_singles_then_doubles_from_the_end():
    assert [b.name for _, b in skip_order(model())] == ["s3", "d2", "s2", "s1", "s0", "d1", "d0"]
    assert [b.name for _, b in skip_order(model(doubles=0, singles=2))] == ["s1", "s0"]


def test_usable_bytes_takes_the_smallest_limit_less_what_is_outside_torch():
    total = 80 * GIB
    # the card, less 1 GiB outside PyTorch (context, other processes): free + reserved = total - 1 GiB
    assert usable_bytes(free=60 * GIB, total=total, reserved=19 * GIB, fraction=1.0, tier_gib=None) == 79 * GIB
    # a memory tier smaller than the card caps it
    assert usable_bytes(free=60 * GIB, total=total, reserved=19 * GIB, fraction=1.0, tier_gib=48) == 47 * GIB
    # PyTorch's per-process fraction caps it too (flux-train bench --vram-cap)
    assert usable_bytes(free=60 * GIB, total=total, reserved=19 * GIB, fraction=0.25, tier_gib=48) == 20 * GIB


def test_blocks_that_fit_takes_sizes_in_order_and_gives_back_when_over():
    assert blocks_that_fit(7, [3, 3, 5]) == 2
    assert blocks_that_fit(5, [3, 3, 5]) == 1
    assert blocks_that_fit(2, [3, 3]) == 0
    assert blocks_that_fit(0, [3, 3]) == 0
    assert blocks_that_fit(-1, [3, 5]) == -1  # each one given back counts at the largest size
    assert blocks_that_fit(-6, [3, 5]) == -2
    assert blocks_that_fit(10, [0, 3]) == 0  # an unmeasured size never counts as free


def test_a_count_unchecks_that_many_from_the_first_step():
    m = model()
    fit = CheckpointFit(3)
    assert "on 4 of 7 blocks, 3 keep" in fit.start(m)
    assert unchecked(m) == ["d2", "s2", "s3"]
    assert fit.decide() is None  # nothing measured, nothing to decide
    fit = CheckpointFit(99)
    fit.start(m := model())
    assert len(unchecked(m)) == 7


def test_auto_measures_two_blocks_then_keeps_what_fits():
    m = model(doubles=3, singles=4)
    mem = FakeMemory(
        {"double": 3 * GIB, "single": 2 * GIB}, peak=23 * GIB, free=10 * GIB, total=40 * GIB, reserved=30 * GIB
    )
    fit = CheckpointFit("auto", memory=mem)
    assert fit.start(m) is None
    assert unchecked(m) == ["d2", "s3"]  # the two measured ones run without checkpointing in the first step
    step(m, mem)
    fit.note_peak()
    line = fit.decide()
    assert fit.per_block == {"double": 3 * GIB, "single": 2 * GIB}
    room = int(40 * GIB * (1 - MARGIN)) - 23 * GIB  # 11 GiB: s2, s1, s0 (2 each), d1 (3) fit, d0 would not
    assert room == 11 * GIB
    assert fit.kept == 6 and unchecked(m) == ["d1", "d2", "s0", "s1", "s2", "s3"], line
    assert "6 keep their activations" in line and "double 3.00, single 2.00 GiB" in line
    blocks = list(m.double_blocks) + list(m.single_blocks)
    assert all(not b._forward_hooks and len(b._forward_pre_hooks) == 1 for b in blocks), "measuring hooks left"


def test_auto_decides_from_the_tightest_process(monkeypatch):
    """With other processes, the decision takes the room and sizes `agree` gives (the tightest of them all)."""
    from flux_trainer.sdscripts import checkpoint_fit

    seen = []

    def agree(room, per_block, selective):  # another process had 5 GiB less room and larger single blocks
        seen.append((room, dict(per_block)))
        return room - 5 * GIB, {**per_block, "single": 3 * GIB}, selective, 2

    monkeypatch.setattr(checkpoint_fit, "agree", agree)
    m = model(doubles=3, singles=4)
    mem = FakeMemory(
        {"double": 3 * GIB, "single": 2 * GIB}, peak=23 * GIB, free=10 * GIB, total=40 * GIB, reserved=30 * GIB
    )
    fit = CheckpointFit("auto", memory=mem)
    fit.start(m)
    step(m, mem)
    line = fit.decide()
    assert seen == [(11 * GIB, {"double": 3 * GIB, "single": 2 * GIB})]  # this process's own figures went in
    assert fit.kept == 4 and unchecked(m) == ["d2", "s1", "s2", "s3"], line  # 6 GiB: s2, s1 (3 each), not s0
    assert "the tightest of 2 processes" in line and "single 3.00" in line


def test_a_process_that_cannot_measure_still_agrees_and_every_process_checkpoints_every_block(monkeypatch, caplog):
    """Each process reaches the agreement's all-reduce even where its own measurement failed (else the others would
    wait there for ever); the tightest room then says so, and every process checkpoints every block."""
    from flux_trainer.sdscripts import checkpoint_fit

    rooms = []

    def agree(room, per_block, selective):
        rooms.append(room)
        return checkpoint_fit.UNMEASURED, per_block, selective, 2  # the other process could not measure

    monkeypatch.setattr(checkpoint_fit, "agree", agree)
    for fail in (True, False):
        m = model()
        mem = FakeMemory({"double": GIB, "single": GIB}, peak=GIB, free=GIB, total=40 * GIB, reserved=GIB)
        fit = CheckpointFit("auto", memory=mem)
        fit.start(m)
        step(m, mem)
        mem.fail = fail
        with caplog.at_level(logging.WARNING, logger="flux_trainer.runner"):
            assert fit.decide() is None
        assert unchecked(m) == []
    assert rooms[0] == checkpoint_fit.UNMEASURED and rooms[1] > 0  # this one failed, then this one measured
    assert "no device" in caplog.text and "another of the 2 processes could not measure" in caplog.text


AGREE = """
    import os, sys
    import torch, torch.distributed as dist
    from flux_trainer.sdscripts.checkpoint_fit import agree
    if sys.argv[2] == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(sys.argv[2])
    rank = dist.get_rank()
    out = agree(100 - 30 * rank, {"single": 7 - rank, "double": 10 + rank}, {"double": 3, "single": 1 + rank})
    torch.save(out, sys.argv[1] + f"/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads stopped before exit (else it can abort at teardown)
"""


def test_agree_gives_every_process_the_smallest_room_and_the_largest_sizes(tmp_path):
    from flux_trainer.sdscripts.checkpoint_fit import agree
    from tests.conftest import two_processes

    assert agree(5, {"double": 1}, {}) == (5, {"double": 1}, {}, 1)  # no process group: as given
    r0, r1 = two_processes(tmp_path, AGREE, "gloo")
    assert r0 == r1 == (70, {"double": 11, "single": 7}, {"double": 3, "single": 2}, 2)


class DoubleBlock(Block):
    def forward(self, img, txt):  # sd-scripts' order: image tokens, then text tokens
        return img + 1, txt + 1


def token_model(doubles: int = 3, singles: int = 4) -> nn.Module:
    m = nn.Module()
    m.double_blocks = nn.ModuleList([DoubleBlock(f"d{i}") for i in range(doubles)])
    m.single_blocks = nn.ModuleList([Block(f"s{i}") for i in range(singles)])
    return m


def token_step(m: nn.Module, mem: FakeMemory, image_tokens: int, text_tokens: int = 512) -> None:
    """One forward with sd-scripts' shapes: double blocks take (img, txt), single blocks the two concatenated."""
    for kind, blocks in (("double", m.double_blocks), ("single", m.single_blocks)):
        for b in blocks:
            b.register_forward_pre_hook(lambda *_, k=kind: setattr(mem, "now", mem.now + mem.grow[k]), prepend=False)
    img, txt = torch.zeros(1, image_tokens, 2), torch.zeros(1, text_tokens, 2)
    for b in m.double_blocks:
        img, txt = b(img=img, txt=txt)  # by name, as sd-scripts calls them
    x = torch.cat([txt, img], dim=1)
    for b in m.single_blocks:
        x = b(x)


@pytest.mark.parametrize(("image_tokens", "kept", "scaled"), [(1024, 4, "scaled 3.00x"), (4096, 7, None)])
def test_auto_scales_a_small_first_batch_to_the_largest_bucket(image_tokens, kept, scaled):
    """bucket_no_upscale keeps small images small: measured on a 512² batch (1024 image tokens + 512 text), a
    1024² one (4096 + 512) holds 3x the activations. Measured on the largest bucket, nothing is scaled."""
    m = token_model()
    mem = FakeMemory({"double": GIB, "single": GIB}, peak=24 * GIB, free=24 * GIB, total=48 * GIB, reserved=24 * GIB)
    mem.now = 20 * GIB  # weights and LoRA, allocated before the first forward
    fit = CheckpointFit("auto", memory=mem, max_image_tokens=4096)
    fit.start(m)
    token_step(m, mem, image_tokens)
    line = fit.decide()
    if scaled:
        # 3 GiB per block; peak 20 + 3 x (24 - 20) = 32 GiB; room 48 x 0.85 - 32 = 8.8 GiB: two more blocks
        assert fit.per_block == {"double": 3 * GIB, "single": 3 * GIB} and scaled in line, line
    else:
        # room 40.8 - 24 = 16.8 GiB at 1 GiB each: every block
        assert fit.per_block == {"double": GIB, "single": GIB} and "scaled" not in line, line
    assert fit.kept == kept


def selective_model() -> nn.Module:
    """token_model with flux_kernels' selective_checkpoint switched on in every block, as its install leaves them."""
    from flux_kernels.memory.selective_checkpoint import ATTR

    m = token_model()
    for b in [*m.double_blocks, *m.single_blocks]:
        setattr(b, ATTR, True)
    return m


def selective(m: nn.Module) -> list[str]:
    from flux_kernels.memory.selective_checkpoint import ATTR

    return [b.name for b in [*m.double_blocks, *m.single_blocks] if b.gradient_checkpointing and getattr(b, ATTR)]


# what selective checkpointing keeps per block in token_step (fp32 hidden states of width 2): the attention output and
# one matmul output per token, 4096 image + 512 text tokens
SEL = 2 * (4096 + 512) * 2 * 4


@pytest.mark.parametrize(
    ("room", "kept", "chosen"),
    [
        (3 * SEL + SEL // 2, 2, ["s0", "s1", "s2"]),  # room for 3 of the 5 checkpointed blocks' selective outputs
        (5 * SEL + 2 * 9 * SEL, 4, ["d0", "d1", "s0"]),  # all 5, then 2 whole blocks at 10 - 1 SEL each
        (-10 * SEL - 1, 0, []),  # no room: the measured blocks go back (both: 1 byte over one), none selective
    ],
)
def test_auto_spends_the_room_on_selective_checkpointing_first(room, kept, chosen):
    m = selective_model()
    total = 2**30
    mem = FakeMemory({"double": 10 * SEL, "single": 10 * SEL}, peak=0, free=0, total=total, reserved=total)
    mem.peak = int(total * (1 - MARGIN)) - room
    fit = CheckpointFit("auto", memory=mem)
    fit.start(m)
    assert selective(m) == []  # the first step measures plain checkpointing
    token_step(m, mem, 4096)
    line = fit.decide()
    assert fit.per_block_selective == {"double": SEL, "single": SEL}
    assert fit.kept == kept and fit.selective == len(chosen) and selective(m) == chosen, line
    assert f"{7 - kept} of 7 blocks, {len(chosen)} of them selectively" in line


@pytest.mark.parametrize(
    ("room", "kept", "chosen"),
    [
        (3 * SEL + SEL // 2, 2, ["d0", "d1", "s0", "s1", "s2"]),  # no room for a whole block; selective costs none
        (2 * 10 * SEL, 4, ["d0", "d1", "s0"]),  # 2 whole blocks at their full 10 SEL (nothing kept on the card)
        (-10 * SEL - 1, 0, ["d0", "d1", "d2", "s0", "s1", "s2", "s3"]),  # no room: the measured blocks go back
    ],
)
def test_with_activation_offload_every_checkpointed_block_keeps_its_selective_outputs_off_the_card(room, kept, chosen):
    """What checkpointed blocks keep waits in host memory: the room is spent on un-checkpointing whole blocks, each at
    its full activations (an un-checkpointed block keeps them on the card)."""
    from flux_kernels.memory.activation_offload import ATTR

    m = selective_model()
    for b in [*m.double_blocks, *m.single_blocks]:
        b.__dict__[ATTR] = object()
    total = 2**30
    mem = FakeMemory({"double": 10 * SEL, "single": 10 * SEL}, peak=0, free=0, total=total, reserved=total)
    mem.peak = int(total * (1 - MARGIN)) - room
    fit = CheckpointFit("auto", memory=mem)
    fit.start(m)
    token_step(m, mem, 4096)
    line = fit.decide()
    assert fit.kept == kept and selective(m) == chosen, line


def test_a_count_or_a_blocked_auto_leaves_selective_checkpointing_on_the_checkpointed_blocks():
    m = selective_model()
    assert "on 5 of 7 blocks, 5 of them selectively, 2 keep" in CheckpointFit(2).start(m)
    assert selective(m) == ["d0", "d1", "s0", "s1", "s2"]
    fit = CheckpointFit("auto", blocked="CUDA graphs record the blocks", memory=object())
    fit.start(m := selective_model())
    assert fit.selective == 7 and len(selective(m)) == 7


def test_auto_without_room_sends_the_measured_blocks_back():
    m = model()
    mem = FakeMemory({"double": 3 * GIB, "single": 2 * GIB}, peak=39 * GIB, free=0, total=40 * GIB, reserved=40 * GIB)
    fit = CheckpointFit("auto", memory=mem)
    fit.start(m)
    step(m, mem)
    fit.decide()
    assert fit.kept == 0 and unchecked(m) == []


def test_auto_keeps_every_block_checkpointed_where_it_must_or_cannot_measure(caplog):
    m = model()
    line = CheckpointFit("auto", blocked="memory.blocks_to_swap: this tier", memory=object()).start(m)
    assert unchecked(m) == [] and "on all 7 blocks" in line and "blocks_to_swap" in line
    assert "no CUDA device" in CheckpointFit("auto", memory=None).start(model())
    mem = FakeMemory({"double": GIB, "single": GIB}, peak=GIB, free=GIB, total=40 * GIB, reserved=GIB)
    fit = CheckpointFit("auto", memory=mem)
    fit.start(m := model())
    step(m, mem)
    mem.fail = True
    with caplog.at_level(logging.WARNING, logger="flux_trainer.runner"):
        assert fit.decide() is None
    assert unchecked(m) == [] and "could not decide" in caplog.text


def test_blocks_that_do_not_checkpoint_are_left_alone():
    m = model()
    for b in m.single_blocks:
        b.gradient_checkpointing = False  # sd-scripts did not enable it there (or no checkpointing at all)
    fit = CheckpointFit(1)
    fit.start(m)
    assert fit.total == 3 and unchecked(m) == ["d2", "s0", "s1", "s2", "s3"]
    assert CheckpointFit("auto", memory=object()).start(model(0, 0)) is None


def test_setting_values():
    assert checkpoint_skip_setting("auto") == "auto" and checkpoint_skip_setting(" AUTO ") == "auto"
    assert checkpoint_skip_setting(12) == 12 and checkpoint_skip_setting("0") == 0
    for bad in ("-1", "half", "1.5"):
        with pytest.raises(ValueError, match="choose auto or a number of blocks"):
            checkpoint_skip_setting(bad)


def test_sd_scripts_blocks_give_the_same_gradients_with_some_unchecked(fm):
    """sd-scripts' own Flux, checkpointing turned on as sd-scripts does: with a count, some blocks run without
    checkpointing, and the input and weight gradients equal the all-checkpointed ones."""
    from tests.conftest import tiny_flux, tiny_flux_forward

    flux = tiny_flux(fm, depth=2, depth_single_blocks=3)
    flux.train()

    def grads(skip: int) -> list[torch.Tensor]:
        flux.zero_grad(set_to_none=True)
        flux.enable_gradient_checkpointing()
        if skip:
            fit = CheckpointFit(skip)
            fit.start(flux)
            assert fit.kept == skip and sum(not b.gradient_checkpointing for b in skip_order_blocks(flux)) == skip
        torch.manual_seed(3)  # tiny_flux_forward draws its timestep from the global generator
        tiny_flux_forward(flux).square().mean().backward()
        return [p.grad.clone() for p in flux.parameters() if p.grad is not None]

    base, mixed = grads(0), grads(3)
    assert len(base) == len(mixed) > 0
    for a, b in zip(base, mixed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sd_scripts_blocks_show_auto_their_tokens(fm):
    """sd-scripts calls its double blocks by keyword (img=, txt=) and its single blocks with text + image tokens in
    one tensor: auto reads both, so a 16-token image and 8 text tokens scale to a 40-token largest bucket as
    (40 + 8) / (16 + 8) = 2."""
    from tests.conftest import tiny_flux, tiny_flux_forward

    flux = tiny_flux(fm, depth=2, depth_single_blocks=3)
    flux.train()
    flux.enable_gradient_checkpointing()
    mem = FakeMemory({}, peak=0, free=0, total=0, reserved=0)
    seen = []
    fit = CheckpointFit("auto", memory=mem, max_image_tokens=40)
    fit.start(flux)
    real = fit._token_scale
    fit._token_scale = lambda kind, given: seen.append((kind, real(kind, given))) or seen[-1][1]
    torch.manual_seed(3)
    tiny_flux_forward(flux, img_tokens=16, txt_tokens=8)
    assert sorted(seen) == [("double", 2.0), ("single", 2.0)]


def skip_order_blocks(flux) -> list[nn.Module]:
    return [b for _, b in skip_order(flux)]


def test_run_hooks_measure_over_the_first_optimizer_step_and_decide_after_it(tmp_path):
    """Through the runner's hooks, with gradient accumulation 2: measured in micro-steps 1-2, decided at 3; the
    peak is kept before the step metrics reset it; TensorBoard gets memory/checkpointed_blocks."""
    from flux_trainer.metrics.health import LossGuard, SlowdownDetector
    from flux_trainer.metrics.step import StepMetrics
    from flux_trainer.sdscripts.hooks import RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    m = model(doubles=3, singles=4)
    mem = FakeMemory(
        {"double": 3 * GIB, "single": 2 * GIB}, peak=23 * GIB, free=10 * GIB, total=40 * GIB, reserved=30 * GIB
    )
    h._unet, h._accumulation, h.fit = m, 2, CheckpointFit("auto", memory=mem)
    h.metrics = StepMetrics("cpu", flops_per_step=1e12, images_per_step=1, nvml=None)
    h.metrics.start()
    h.loss_guard, h.slowdown = LossGuard(patience=3), SlowdownDetector(nvml=None)
    h.step_start()
    assert unchecked(m) == ["d2", "s3"]
    step(m, mem)
    h.step_start()  # micro-step 2: same optimizer step, nothing decided yet
    assert h.fit.kept == 2
    tags = h.step_end(None, {}, 1)
    mem.peak = 0  # what a reset leaves behind: the decision must use the peak read before it
    assert tags["memory/checkpointed_blocks"] == 5.0
    h.step_start()
    assert h.fit.kept == 6 and h.step_end(None, {}, 2)["memory/checkpointed_blocks"] == 1.0


def test_run_hooks_log_how_many_blocks_checkpoint_selectively(tmp_path):
    from flux_trainer.metrics.health import LossGuard, SlowdownDetector
    from flux_trainer.metrics.step import StepMetrics
    from flux_trainer.sdscripts.hooks import RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    h._unet, h.fit, h.kernels_installed = selective_model(), CheckpointFit(2), ["selective_checkpoint"]
    h.metrics = StepMetrics("cpu", flops_per_step=1e12, images_per_step=1, nvml=None)
    h.metrics.start()
    h.loss_guard, h.slowdown = LossGuard(patience=3), SlowdownDetector(nvml=None)
    h.step_start()
    tags = h.step_end(None, {}, 1)
    assert tags["memory/checkpointed_blocks"] == 5.0 and tags["memory/selective_blocks"] == 5.0
    h.kernels_installed = []
    assert "memory/selective_blocks" not in h.step_end(None, {}, 2)


def test_make_checkpoint_fit_from_the_runner_spec():
    from flux_trainer.sdscripts.hooks import make_checkpoint_fit

    cpu = torch.device("cpu")
    assert make_checkpoint_fit({"checkpoint_skip": "0"}, cpu, []) is None
    fit = make_checkpoint_fit({"checkpoint_skip": "auto", "tier_gib": 48.0}, cpu, [])
    assert fit.memory is None and fit.tier_gib == 48.0  # no CUDA: nothing to measure
    fit = make_checkpoint_fit({"checkpoint_skip": "auto"}, cpu, ["compile_blocks", "cuda_graphs"])
    assert "CUDA graphs" in fit.blocked
    assert make_checkpoint_fit({"checkpoint_skip": "5"}, cpu, ["cuda_graphs"]).setting == 5


def test_room_is_what_torch_may_still_allocate():
    """usable_bytes (the card less what is outside PyTorch, within its fraction) less what PyTorch holds now."""
    from types import SimpleNamespace

    def card(fraction):
        return SimpleNamespace(free_total=lambda: (60 * GIB, 80 * GIB), reserved=lambda: 19 * GIB,
                               allocated=lambda: 12 * GIB, fraction=lambda: fraction)  # fmt: skip

    assert room_bytes(card(1.0)) == 79 * GIB - 12 * GIB  # 1 GiB outside PyTorch (the context, others)
    assert room_bytes(card(0.25)) == 20 * GIB - 12 * GIB  # bench --vram-cap's fraction
