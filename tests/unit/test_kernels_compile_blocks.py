"""flux_kernels.patches.compile_blocks: graph-safe RNG functionalisation is turned off only where it is what keeps
checkpointed compiled graphs out of the FX graph cache and no CUDA graphs need it, and is put back on removal."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._functorch import config as functorch_config
from torch._prims import rng_prims

from flux_kernels.patches import compile_blocks, graph_record, patch
from flux_kernels.patches.blocks import find_blocks
from tests.conftest import tiny_flux, tiny_flux_forward, undoing


@pytest.fixture
def graphsafe_uncacheable(monkeypatch, torch_config):
    """This torch as 2.11 is: the graph-safe RNG op not cacheable, the host-state ones cacheable."""
    monkeypatch.setattr(rng_prims.graphsafe_run_with_rng_state, "cacheable", lambda: False)
    monkeypatch.setattr(rng_prims.run_and_save_rng_state, "cacheable", lambda: True)
    monkeypatch.setattr(rng_prims.run_with_rng_state, "cacheable", lambda: True)
    torch_config(functorch_config, graphsafe_rng_functionalization=True)
    yield
    compile_blocks.restore()
    compile_blocks.restore_autograd_functions()


def test_turned_off_only_where_it_blocks_the_cache_and_no_cuda_graphs(graphsafe_uncacheable, monkeypatch):
    assert compile_blocks.graphsafe_rng_blocks_cache()
    assert compile_blocks.prefer_cacheable_rng(cuda_graphs=True) is None  # CUDA graphs need the graph-safe op
    assert functorch_config.graphsafe_rng_functionalization is True
    assert "cacheable" in compile_blocks.prefer_cacheable_rng(cuda_graphs=False)
    assert functorch_config.graphsafe_rng_functionalization is False
    assert compile_blocks.restore() and functorch_config.graphsafe_rng_functionalization is True
    assert not compile_blocks.restore()  # nothing left to undo

    monkeypatch.setattr(rng_prims.graphsafe_run_with_rng_state, "cacheable", lambda: True)  # a torch that caches it
    assert not compile_blocks.graphsafe_rng_blocks_cache()
    assert compile_blocks.prefer_cacheable_rng(cuda_graphs=False) is None
    assert functorch_config.graphsafe_rng_functionalization is True


def test_this_torch_as_installed_decides_by_its_own_flags():
    """No stand-ins: the decision reads the installed torch's operators (2.13 caches the graph-safe op)."""
    graphsafe, plain = rng_prims.graphsafe_run_with_rng_state, rng_prims.run_and_save_rng_state
    assert compile_blocks.graphsafe_rng_blocks_cache() == (not graphsafe.cacheable() and plain.cacheable())


class Block(nn.Module):
    """The attributes find_blocks recognises a single-stream block by; never called here."""

    def __init__(self):
        super().__init__()
        self.linear1, self.linear2, self.pre_norm = (
            nn.Linear(4, 4),
            nn.Linear(4, 4),
            nn.LayerNorm(4, elementwise_affine=False),
        )
        self.modulation, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)
        self.mlp_act, self.hidden_size, self.mlp_hidden_dim, self.num_heads = nn.GELU(), 4, 4, 1

    def _forward(self, x, vec, pe, txt_attention_mask=None):
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.single_blocks = nn.ModuleList([Block(), Block()])


def test_install_compile_says_so_and_remove_kernels_restores(graphsafe_uncacheable):
    model = Model()
    if not find_blocks(model)[1]:
        pytest.fail("the stand-in block is not recognised as a single-stream block")
    line = compile_blocks.install(model, mode="reduce-overhead")  # CUDA graphs: left as it is
    assert "RNG" not in line and functorch_config.graphsafe_rng_functionalization is True
    assert "combo kernels" not in line
    patch.remove_kernels(model)
    line = compile_blocks.install(model, options={"triton.cudagraphs": True, "combo_kernels": True})  # the same
    assert "RNG" not in line and "(combo kernels)" in line
    assert line.endswith("(CUDA graph recording: indexed alias lookups)") and graph_record.installed()
    assert "graph_record" in patch.remove_kernels(model) and not graph_record.installed()
    line = compile_blocks.install(model)
    assert "RNG state saved on the host" in line and functorch_config.graphsafe_rng_functionalization is False
    assert "CUDA graph" not in line and not graph_record.installed()  # no graphs: nothing recorded
    assert "compile_rng" in patch.remove_kernels(model)
    assert functorch_config.graphsafe_rng_functionalization is True


def test_blocks_with_the_fused_ops_keep_the_graph_safe_rng(graphsafe_uncacheable):
    """flux_kernels.ops.fast.TRACED: on the H200 a compiled, checkpointed double block with the fused ops patched in had
    wrong gradients at its second shape with the RNG state saved on the host, right ones with the graph-safe op."""
    from flux_kernels.patches.blocks import ATTR
    from flux_kernels.patches.patch import BlockOps

    model = Model()
    for b in model.single_blocks:
        setattr(b, ATTR, BlockOps(modulate=True, gated_residual=True))
    line = compile_blocks.install(model)
    assert "RNG" not in line and functorch_config.graphsafe_rng_functionalization is True
    assert "modulate, gated_residual: inductor's code inside the compiled blocks" in line
    compile_blocks.remove(model)
    for b in model.single_blocks:
        setattr(b, ATTR, BlockOps())  # attention alone, as in kernels=auto: the cacheable variant
    assert "RNG state saved on the host" in compile_blocks.install(model)
    compile_blocks.remove(model)


def _train_step(model) -> None:
    tiny_flux_forward(model).square().mean().backward()


def test_one_compiled_double_block_graph_for_every_double_block(fm):
    """sd-scripts' Flux (tiny, 3 double + 1 single blocks) with sd-scripts' LoRA: compiled block by block as such,
    the first double block (inputs from the frozen img_in / txt_in, no grad) gets a graph of its own, the others
    another (torch.compile guards on requires_grad); through `install`, one graph serves all of them, and the
    LoRA's gradients are the same."""
    import importlib

    from torch._dynamo.utils import counters

    lora_flux = importlib.import_module("networks.lora_flux")

    def train_once(use_install: bool) -> tuple[int, list[torch.Tensor]]:
        model = tiny_flux(fm, depth=3, depth_single_blocks=1).requires_grad_(False)
        net = lora_flux.create_network(1.0, 4, 4, None, [None, None], model)
        net.apply_to([], model, apply_text_encoder=False, apply_unet=True)
        for p in net.parameters():  # lora_up starts at zero: give it values so every gradient is non-trivial
            p.data = 0.05 * torch.randn_like(p)
        if use_install:
            assert "one double-block graph" in compile_blocks.install(model)
        else:
            for b in [*model.double_blocks, *model.single_blocks]:
                b.compile()
        torch._dynamo.reset()
        graphs = counters["stats"]["unique_graphs"]
        _train_step(model)
        grads = [p.grad.clone() for p in net.parameters()]
        compile_blocks.remove(model)
        assert not any(m._forward_hooks for m in (model.img_in, model.txt_in))
        return counters["stats"]["unique_graphs"] - graphs, grads

    with undoing(torch._dynamo.reset):
        plain_graphs, plain_grads = train_once(use_install=False)
        graphs, grads = train_once(use_install=True)
    assert plain_graphs == 3  # double (first), double (the others), single
    assert graphs == 2
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _tiny_flux_with(fm, names: list[str], choice: str | None, options: dict):
    """sd-scripts' tiny Flux with flux_kernels `names` installed; `choice` stands in for the attention probe's
    verdict at the run's shape (1, 2, 24, 128) float32 (the probe itself is timing, not what is tested here)."""
    from flux_kernels.runtime import registry

    model = tiny_flux(fm)
    model.requires_grad_(False).img_in.requires_grad_(True)
    patch.apply_kernels(model, registry.unchecked(names), options=options, verify=False)
    dispatch = model.double_blocks[0]._flux_kernels.attention
    if choice is not None:
        dispatch.choice[dispatch.shape_key((1, 2, 24, 128), torch.float32, "cpu", False)] = choice
    return model


@pytest.mark.parametrize("choice, fused", [("sdpa_flash", True), ("sdpa_math", False)])
def test_compiled_blocks_call_the_backend_the_probe_chose(fm, tmp_path, choice, fused):
    """The run's attention backend reaches the compiled graphs (set around each compiled call): on the CPU the flash
    backend is one fused op in the traced forward, the math backend is matmuls and a softmax."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    traced = []

    def forward_compiler(gm, example_inputs):
        traced.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    options = {
        "attention": {"cache_path": tmp_path / "attention.json", "device": torch.device("cpu")},
        "compile_blocks": {"backend": aot_autograd(fw_compiler=forward_compiler)},
    }
    model = _tiny_flux_with(fm, ["attention", "compile_blocks"], choice, options)
    torch._dynamo.reset()
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        _train_step(model)
    assert traced, "nothing was compiled"
    assert any("_scaled_dot_product_flash_attention_for_cpu" in t for t in traced) == fused, sorted(set(traced))


def test_compiled_blocks_with_cudnn_fa4_call_its_ops_and_train_as_with_sdpa(fm, tmp_path):
    """With `cudnn_fa4` as the run's choice the compiled blocks' forward graphs call its forward op and the backward
    graphs its backward op (on the CPU both run their plain-PyTorch math), through FLUX's real blocks, its output
    taken as tokens by a view where other backends' is copied by heads_to_tokens; the loss and the gradients are
    those of the same blocks on PyTorch's math backend."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def run(choice):
        traced = {"fw": [], "bw": []}

        def compiler(kind):
            def compile_graph(gm, example_inputs):
                traced[kind].extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                return make_boxed_func(gm.forward)

            return compile_graph

        options = {
            "attention": {"cache_path": tmp_path / f"{choice}.json", "device": torch.device("cpu")},
            "compile_blocks": {"backend": aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))},
        }
        model = _tiny_flux_with(fm, ["attention", "compile_blocks"], choice, options)
        torch._dynamo.reset()
        with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
            loss = tiny_flux_forward(model).square().mean()
            loss.backward()
        return loss.detach(), [p.grad for p in model.img_in.parameters()], traced

    loss, grads, traced = run("cudnn_fa4")
    want_loss, want_grads, want_traced = run("sdpa_math")
    assert any("cudnn_lse_attention" in t for t in traced["fw"]), sorted(set(traced["fw"]))
    assert not any("heads_to_tokens" in t for t in traced["fw"])
    assert any("heads_to_tokens" in t for t in want_traced["fw"]), sorted(set(want_traced["fw"]))
    assert any("fa4_attention_backward" in t for t in traced["bw"]), sorted(set(traced["bw"]))
    assert not any("scaled_dot_product" in t for t in traced["fw"])
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_compiled_blocks_with_a_chosen_backend_stay_in_the_autograd_cache(fm, tmp_path, monkeypatch, torch_config):
    """A backend switch inside traced code put a call the AOTAutograd cache cannot key into every graph (measured
    on the H200: 'Unsupported call_function target ... _backend_from_string', 2 of 4 graphs bypassed in every run);
    held around the compiled call instead, nothing bypasses."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch_config(torch._inductor.config, fx_graph_cache=True)
    torch_config(torch._functorch.config, enable_autograd_cache=True)
    options = {"attention": {"cache_path": tmp_path / "attention.json", "device": torch.device("cpu")}}
    model = _tiny_flux_with(fm, ["attention", "compile_blocks"], "sdpa_flash", options)
    torch._dynamo.reset()
    before = {k: counters["aot_autograd"][f"autograd_cache_{k}"] for k in ("bypass", "miss")}
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        _train_step(model)
    assert counters["aot_autograd"]["autograd_cache_miss"] > before["miss"]  # the graphs went through the cache
    assert counters["aot_autograd"]["autograd_cache_bypass"] == before["bypass"]


def test_graph_recording_keeps_torchs_lookups_when_asked(monkeypatch):
    monkeypatch.setenv(compile_blocks.GRAPH_RECORD_ENV, "torch")
    model = Model()
    line = compile_blocks.install(model, options={"triton.cudagraphs": True})
    assert line.endswith("(CUDA graph recording: torch's own lookups (FLUX_KERNELS_GRAPH_RECORD=torch))")
    assert not graph_record.installed()
    assert "graph_record" not in patch.remove_kernels(model)


def _cached_run(fm, tmp_path) -> tuple[dict[str, int], list[torch.Tensor], str]:
    """A fresh tiny Flux with single_qkv (an autograd.Function in the single blocks' graph), compiled and trained one
    step from an empty in-memory state; AOTAutograd's cache outcomes, the trained inputs' gradients and the code
    inductor generated (none where the cache had it)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    options = {"attention": {"cache_path": tmp_path / "attention.json", "device": torch.device("cpu")}}
    model = _tiny_flux_with(fm, ["attention", "single_qkv", "compile_blocks"], "sdpa_math", options)
    torch._dynamo.reset()
    before = {k: counters["aot_autograd"][f"autograd_cache_{k}"] for k in ("bypass", "miss", "hit")}
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        _, codes = run_and_get_code(_train_step, model)
        grads = [p.grad.clone() for p in model.img_in.parameters()]
    return {k: counters["aot_autograd"][f"autograd_cache_{k}"] - n for k, n in before.items()}, grads, "\n".join(codes)


@pytest.mark.parametrize("backward", ["torch", "triton"])
def test_graphs_with_autograd_functions_stay_in_the_autograd_cache(fm, tmp_path, monkeypatch, torch_config, backward):
    """AOTAutograd's cache bypassed every graph holding an autograd.Function (single_qkv's at vram80 on the H100: the
    single-block graph compiled anew in every run, 4.2 s of a warm first step). With compile_blocks' switch the
    first run stores it and the second loads it, with the same gradients; the switch is put back on removal. Both
    of single_qkv's backwards: torch ops, and the Triton kernel's custom op (through Triton's interpreter here)."""
    from flux_kernels.ops import fast

    if backward == "triton":
        pytest.importorskip("triton", reason="triton is not installed: only the torch backward can run")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        fast._ops_lib()  # registered before tracing, as training's probe does (registered traced, the graph breaks)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch_config(torch._inductor.config, fx_graph_cache=True)
    torch_config(torch._functorch.config, enable_autograd_cache=True)
    torch_config(torch._functorch.config, **{compile_blocks.AUTOGRAD_FUNCTIONS: False})
    with monkeypatch.context() as m:
        m.setattr(compile_blocks, "cache_autograd_functions", lambda: None)  # torch's default, to show what it does
        without, _, _ = _cached_run(fm, tmp_path)
    assert without["bypass"] > 0, without
    first, want, code = _cached_run(fm, tmp_path)
    second, got, _ = _cached_run(fm, tmp_path)
    assert first["bypass"] == second["bypass"] == 0 and first["miss"] > 0, (first, second)
    assert second["hit"] == first["miss"] and second["miss"] == 0, (first, second)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert getattr(torch._functorch.config, compile_blocks.AUTOGRAD_FUNCTIONS) is False
    assert ("flux_kernels.single_qkv_bwd" in code) == (backward == "triton"), "not the backward asked for"


def test_a_changed_backward_is_a_cache_miss(tmp_path, monkeypatch, torch_config):
    """The key of a graph with an autograd.Function covers what its backward computes (a constant in it here)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch_config(torch._inductor.config, fx_graph_cache=True)
    torch_config(torch._functorch.config, enable_autograd_cache=True)
    torch_config(torch._functorch.config, **{compile_blocks.AUTOGRAD_FUNCTIONS: True})

    def grad_with(k: float) -> tuple[torch.Tensor, int]:
        class Sin(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x.sin()

            @staticmethod
            def backward(ctx, g):
                return g * ctx.saved_tensors[0].cos() * k

        torch._dynamo.reset()
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        x = torch.randn(8, generator=torch.Generator().manual_seed(0)).requires_grad_()
        torch.compile(lambda t: Sin.apply(t) + 1)(x).sum().backward()
        return x.grad, counters["aot_autograd"]["autograd_cache_hit"] - hits

    with undoing(torch._dynamo.reset):
        (one, _), (one_again, hit), (three, hit3) = grad_with(1.0), grad_with(1.0), grad_with(3.0)
    assert hit == 1 and hit3 == 0
    torch.testing.assert_close(one_again, one)
    torch.testing.assert_close(three, 3 * one)


def test_installing_kernels_and_the_first_forward_draw_nothing_from_the_runs_random_streams(fm, tmp_path):
    """sd-scripts' shuffled DataLoader seeds itself from torch's global generator once training iterates, after the
    kernels are installed, and Python's `random` shuffles its buckets: a kernel that drew from either (its probe,
    its install and verification, the attention probe at the first forward, compiling) would give kernels=auto other
    batches than kernels=off with the same seed, as graph_record's probe once did where blocks replay from CUDA
    graphs. The kernels that install on a CPU, compiled."""
    import random

    from flux_kernels.runtime import registry

    model = tiny_flux(fm)
    model.requires_grad_(False).img_in.requires_grad_(True)
    torch.manual_seed(3)
    random.seed(3)
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    options = {"attention": {"cache_path": tmp_path / "attention.json", "device": torch.device("cpu")}}
    names = ["attention", "single_qkv", "flux_prologue", "compile_blocks"]
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        installed = patch.apply_kernels(model, registry.unchecked(names), options=options)
        dispatch = model.double_blocks[0]._flux_kernels.attention
        tiny_flux_forward(model).square().mean().backward()
    assert sorted(installed) == sorted(names)
    assert dispatch.run_choice is not None  # the first forward probed
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
