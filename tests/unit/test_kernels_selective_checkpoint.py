"""flux_kernels.memory.selective_checkpoint: which ops a checkpointed block keeps, the hook into sd-scripts' blocks
(their module's `checkpoint`), and on sd-scripts' own tiny Flux, eager and compiled: the same outputs and gradients, the
attention and the wide-input matmuls no longer recomputed in backward, their outputs kept instead."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flux_kernels.memory import selective_checkpoint as sac
from flux_kernels.ops.reference import saved_bytes
from flux_kernels.patches import fp8, patch
from flux_kernels.runtime import applies, registry
from flux_kernels.runtime.errors import KernelError
from tests.conftest import tiny_flux, tiny_flux_forward, undoing

aten = torch.ops.aten


def t(*shape):
    return torch.empty(*shape, device="meta")


def test_the_policy_keeps_attention_and_matmuls_whose_input_is_much_wider_than_their_output():
    q = t(1, 2, 9, 16)
    assert sac.keeps(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q))
    assert sac.keeps(aten._scaled_dot_product_cudnn_attention.default, (q, q, q))
    assert sac.keeps(aten.mm.default, (t(9, 15360), t(15360, 3072)))  # linear2
    assert sac.keeps(aten.addmm.default, (t(3072), t(9, 12288), t(12288, 3072)))  # MLP down, with its bias
    assert sac.keeps(aten.mm.default, (t(9, 3072), t(3072, 16)))  # a LoRA down-projection
    assert sac.keeps(fp8.fp8_mm_quantized._opoverload, (t(9, 15360), t(9, 15360), t(9, 1), t(3072, 15360), t(1, 3072)))
    assert sac.keeps(fp8.fp8_mm._opoverload, (t(9, 12288), t(3072, 12288), t(1, 3072)))
    for shapes in ((t(9, 3072), t(3072, 9216)), (t(9, 3072), t(3072, 3072)), (t(9, 16), t(16, 3072))):
        assert not sac.keeps(aten.mm.default, shapes)  # qkv, proj, a LoRA up-projection
    assert not sac.keeps(fp8.fp8_mm._opoverload, (t(9, 3072), t(21504, 3072), t(1, 21504)))  # linear1
    assert not sac.keeps(aten.gelu.default, (t(9, 12288),))
    assert not sac.keeps(aten.bmm.default, (t(2, 9, 4096), t(2, 4096, 4)))  # not a Linear's matmul
    assert sac.policy(None, aten.mm.default, t(9, 64), t(64, 16)) == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE


def test_the_probe_region_matches_plain_checkpointing():
    assert registry.probe(registry.REGISTRY["selective_checkpoint"], "cpu").ok
    assert registry.REGISTRY["selective_checkpoint"].in_auto
    assert "CUDA" in registry.select("auto", "cpu").skipped["selective_checkpoint"]  # a speed-up for GPUs only


class Calls(TorchDispatchMode):
    """How many times each op runs (by overload packet name)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _model(fm, selective: bool, compiled: bool = False):
    model = tiny_flux(fm).train()
    model.enable_gradient_checkpointing()
    if compiled:
        for b in (*model.double_blocks, *model.single_blocks):
            b.compile()
    if selective:
        assert "1 double + 1 single" in sac.install(model)
    return model


def _grads(model, calls: Calls | None = None):
    out = tiny_flux_forward(model, img_tokens=64, txt_tokens=16)
    params = [p for p in model.parameters() if p.requires_grad]
    if calls is None:
        grads = torch.autograd.grad(out.square().mean(), params)
    else:
        with calls:
            grads = torch.autograd.grad(out.square().mean(), params)
    return [out.detach(), *grads]


def test_sd_scripts_blocks_skip_recomputing_attention_and_wide_matmuls_with_the_same_gradients(fm):
    plain_calls, selective_calls = Calls(), Calls()
    want = _grads(_model(fm, selective=False), plain_calls)
    model = _model(fm, selective=True)
    removed = []
    with undoing(lambda: removed.append(sac.remove(model))):
        got = _grads(model, selective_calls)
    assert removed == [True]
    assert len(got) == len(want) > 40
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert plain_calls.calls[attention] == 2  # the double and the single block recompute theirs in backward
    assert attention not in selective_calls.calls
    # linear2, and the double block's two MLP down-projections: the matmuls with K >= 4 N recomputed no more
    assert plain_calls.calls["addmm"] - selective_calls.calls["addmm"] == 3


def test_compiled_blocks_keep_what_the_policy_says_with_the_same_gradients(fm, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    with undoing(lambda: sac.remove(model), torch._dynamo.reset):
        plain = _model(fm, selective=False, compiled=True)
        want = _grads(plain)
        plain_bytes = saved_bytes(lambda: tiny_flux_forward(plain, img_tokens=64, txt_tokens=16), ())
        torch._dynamo.reset()
        model = _model(fm, selective=True, compiled=True)
        got = _grads(model)
        kept = saved_bytes(lambda: tiny_flux_forward(model, img_tokens=64, txt_tokens=16), ())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # kept besides: the two blocks' attention outputs [1, 80, 256] fp32 and the single block's linear2 output of the
    # same size at least (the double block's MLP down-projections come on top; 308 KiB in all on torch 2.13)
    assert kept - plain_bytes >= 3 * 80 * 256 * 4, (kept, plain_bytes)


def _cache_counts(fm) -> dict[str, int]:
    """AOTAutograd cache outcomes of compiling and running the selectively checkpointed tiny Flux once."""
    from torch._dynamo.utils import counters

    before = dict(counters["aot_autograd"])
    torch._dynamo.reset()
    model = _model(fm, selective=True, compiled=True)
    with undoing(lambda: sac.remove(model), torch._dynamo.reset):
        _grads(model)
    return {
        k: counters["aot_autograd"][f"autograd_cache_{k}"] - before.get(f"autograd_cache_{k}", 0)
        for k in ("hit", "miss", "bypass")
    }


def test_selectively_checkpointed_graphs_stay_in_the_autograd_cache_keyed_on_the_policy(
    fm, tmp_path, monkeypatch, torch_config
):
    """torch bypasses AOTAutograd's cache for a graph whose checkpoint context_fn has no `cache_hash` (measured on the
    H200: both checkpointed graphs compiled anew in every run). With it, a second run hits the cache, and a changed
    policy (RATIO) misses rather than reusing graphs that keep other outputs."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch_config(torch._inductor.config, fx_graph_cache=True)
    torch_config(torch._functorch.config, enable_autograd_cache=True)
    first = _cache_counts(fm)
    assert first["miss"] >= 2 and first["bypass"] == 0, first  # the double and the single block's graphs
    assert _cache_counts(fm) == {"hit": first["miss"], "miss": 0, "bypass": 0}
    monkeypatch.setattr(sac, "RATIO", sac.RATIO + 1)
    assert _cache_counts(fm)["miss"] == first["miss"]


def test_compile_blocks_routes_plain_checkpointing_through_a_recompute_everything_context(
    fm, tmp_path, monkeypatch, torch_config
):
    """torch 2.11 missed the ops inside autograd.Functions when it tagged a plainly checkpointed region (see
    flux_kernels.memory.selective_checkpoint; measured on the H200 in tests/gpu). compile_blocks routes such blocks
    through `plain_contexts`: the same gradients and saved tensors as torch's own plain checkpointing here (2.13
    does the same internally), graphs that stay in the autograd cache, and sd-scripts' `checkpoint` back after."""
    from torch._dynamo.utils import counters

    from flux_kernels.patches import compile_blocks

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch_config(torch._inductor.config, fx_graph_cache=True)
    torch_config(torch._functorch.config, enable_autograd_cache=True)
    original = fm.checkpoint
    torch._dynamo.reset()
    plain = _model(fm, selective=False, compiled=True)
    want, want_bytes = _grads(plain), saved_bytes(lambda: tiny_flux_forward(plain, img_tokens=64, txt_tokens=16), ())
    torch._dynamo.reset()
    model = _model(fm, selective=False)
    before = dict(counters["aot_autograd"])
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        assert "plainly checkpointed blocks recompute all their ops" in compile_blocks.install(model)
        assert fm.checkpoint is sac.checkpoint
        blocks = [*model.double_blocks, *model.single_blocks]
        assert all(getattr(b, sac.ROUTED, False) and not getattr(b, sac.ATTR, False) for b in blocks)
        got = _grads(model)  # `plain_contexts` for these blocks: test_calls_it_does_not_own_pass_through_unchanged
        kept = saved_bytes(lambda: tiny_flux_forward(model, img_tokens=64, txt_tokens=16), ())
        bypass = counters["aot_autograd"]["autograd_cache_bypass"] - before.get("autograd_cache_bypass", 0)
    assert fm.checkpoint is original
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert kept == want_bytes, (kept, want_bytes)
    assert bypass == 0


def test_install_hooks_only_the_installed_models_blocks_and_remove_restores(fm):
    original = fm.checkpoint
    model, other = _model(fm, selective=True), _model(fm, selective=False)
    removed = []
    with undoing(lambda: removed.append(sac.remove(model))):
        assert fm.checkpoint is sac.checkpoint
        calls = Calls()
        _grads(other, calls)  # a block without the switch: checkpointed as sd-scripts does
        assert calls.calls["_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert removed == [True]
    assert fm.checkpoint is original and not sac.remove(model)


def test_a_module_that_does_not_call_checkpoint_by_that_name_is_an_error(fm, monkeypatch):
    monkeypatch.setattr(fm, "checkpoint", lambda *a, **k: None)
    with pytest.raises(KernelError, match="does not call torch.utils.checkpoint.checkpoint"):
        sac.install(tiny_flux(fm))


def test_calls_it_does_not_own_pass_through_unchanged(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda fn, *a, **k: seen.append(k) or fn(*a))

    class Block(torch.nn.Module):
        def _forward(self, x):
            return x

    block, plain = Block(), Block()
    setattr(block, sac.ROUTED, True)
    setattr(block, sac.ATTR, True)
    setattr(plain, sac.ROUTED, True)  # routed by compile_blocks, not selective (or the planner switched it off)
    x = torch.ones(2)
    sac.checkpoint(block._forward, x, use_reentrant=False)
    sac.checkpoint(plain._forward, x, use_reentrant=False)
    sac.checkpoint(block._forward, x)  # reentrant: no context_fn there
    sac.checkpoint(Block()._forward, x, use_reentrant=False)  # another model's block
    sac.checkpoint(lambda y: y, x, use_reentrant=False)  # not a block's method
    mine = {"use_reentrant": False, "context_fn": lambda: None}
    sac.checkpoint(block._forward, x, **mine)  # a context of the caller's own
    assert seen[0]["context_fn"] is sac.contexts and seen[1]["context_fn"] is sac.plain_contexts
    assert all("context_fn" not in k for k in seen[2:5]) and seen[5]["context_fn"] is mine["context_fn"]
    assert len(seen) == 6


def test_auto_takes_it_only_where_blocks_are_checkpointed_on_the_card():
    model = torch.nn.Module()
    assert not applies.checkpoints_blocks(model)[0]  # no checkpointing: nothing recomputed
    model.gradient_checkpointing = True
    assert applies.checkpoints_blocks(model)[0]
    model.blocks_to_swap = 8
    assert "block swap" in applies.checkpoints_blocks(model)[1]
    model.blocks_to_swap, model.cpu_offload_checkpointing = 0, True
    assert "offloaded" in applies.checkpoints_blocks(model)[1]


def test_torchs_in_place_warning_is_dropped_and_nothing_else():
    import logging

    sac._quiet_torch_warning()
    logger = logging.getLogger("torch._higher_order_ops.wrap")  # torch's loggers do not propagate to the root
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    with undoing(lambda: logger.removeHandler(handler)):
        logger.warning("Detected that context_fn is passed to torch.utils.checkpoint under torch.compile.")
        logger.warning("something else")
    assert seen == ["something else"]
