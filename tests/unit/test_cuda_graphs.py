"""kernels.cuda_graphs: where the compiled blocks replay from CUDA graphs (auto / true / false), what stops them,
and what the runner does with the decision (compile mode, a step mark per step, a report of skipped graphs)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.plan import cuda_graphs_decision, cuda_graphs_setting
from flux_trainer.sdscripts import compile_report, kernel_install
from flux_trainer.sdscripts import hooks as hooks_mod
from tests.conftest import undoing


@pytest.mark.parametrize(
    ("overrides", "gpu", "want"),
    [
        (["memory=vram80"], True, True),  # no checkpointing: memory is not traded for speed
        (["memory=vram48"], True, True),  # checkpointing tiers with room for the graphs' ~1.5 GiB (memory.cuda_graphs)
        (["memory=vram24"], True, True),
        (["memory=vram16"], True, True),  # block_swap: the same buffers at every use, and room for the pools
        (["memory=vram12"], True, True),
        (["memory=vram8"], True, False),  # measured no faster there (memory.cuda_graphs=false)
        (["memory=vram8", "kernels.cuda_graphs=true"], True, True),
        # samples on a tier that swaps: the pools left the autoencoder's decode too little of the card
        (["memory=vram16", "sample.prompts=[a red square]"], True, False),
        (["memory=vram16", "sample.prompts=[a red square]", "kernels.cuda_graphs=true"], True, True),
        (["memory=vram24", "sample.prompts=[a red square]"], True, True),  # nothing swapped
        (["memory=vram48", "memory.fp8_base=false", "memory.cuda_graphs=false"], True, False),
        (["memory=vram80", "kernels=off"], True, False),
        (["memory=vram80", "kernels=fused"], True, False),  # no compile_blocks in that set
        (["memory=vram80", "kernels=compile"], True, True),
        (["memory=vram80", "kernels.set='auto,qk_norm_rope'"], True, True),  # auto plus one
        (["memory=vram80", "kernels.set='auto,-compile_blocks'"], True, False),  # auto without the compile
        (["memory=vram80"], False, False),  # a CPU run
        (["memory=vram80", "train.gradient_accumulation_steps=2"], True, False),
        (["memory=vram48", "memory.cuda_graphs=false", "kernels.cuda_graphs=true"], True, True),
        (["memory=vram80", "kernels.cuda_graphs=false"], True, False),
        (["memory=vram80", "kernels.set='auto,activation_offload'"], True, True),  # nothing checkpointed to offload
        # the offloaded tensors are held until their copies are done (flux_kernels.memory.activation_offload.HOLD)
        (["memory=vram24", "kernels.cuda_graphs=true", "kernels.set='auto,activation_offload'"], True, True),
        (["memory=vram24", "kernels=offload"], True, True),  # the preset: the same two
        # Chroma's text length changes per batch: every new length would record new graphs
        (["model=random_chroma", "memory=vram80"], True, False),
        (["model=random_chroma", "memory=vram80", "kernels.cuda_graphs=true"], True, True),
    ],
)
def test_decision(compose, overrides, gpu, want):
    assert cuda_graphs_decision(compose("+dataset=mychar", *overrides), gpu=gpu) is want


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["memory=vram16", "kernels.set='auto,-block_swap'"], "blocks_to_swap without the block_swap kernel"),
        (["memory=vram24", "memory.cpu_offload_checkpointing=true"], "cpu_offload_checkpointing moves"),
        (["train.gradient_accumulation_steps=4"], "gradient_accumulation_steps"),
        (["kernels=off"], "kernels=off"),
        (["kernels.set='auto,-compile_blocks'"], "kernels.set=auto,-compile_blocks compiles no blocks"),
    ],
)
def test_asking_where_graphs_cannot_run_is_an_error_naming_why(compose, overrides, words):
    cfg = compose("+dataset=mychar", "kernels.cuda_graphs=true", *overrides)
    with pytest.raises(ConfigError, match="kernels.cuda_graphs=true") as e:
        cuda_graphs_decision(cfg)
    assert words in str(e.value)


def test_the_offload_preset_is_auto_with_activation_offload_replayed_from_graphs(compose):
    from flux_kernels.runtime.request import parse_request

    cfg = compose("+dataset=mychar", "memory=vram24", "kernels=offload")
    request = parse_request(str(cfg.kernels.set))
    assert request.wants("activation_offload", in_auto=False) and request.wants("compile_blocks", in_auto=True)
    assert cuda_graphs_setting(cfg) == "true"


def test_the_offload_preset_where_graphs_cannot_run_says_the_preset_asked_for_them(compose):
    offloaded = "memory.cpu_offload_checkpointing=true"
    cfg = compose("+dataset=mychar", "memory=vram24", offloaded, "kernels=offload")
    with pytest.raises(ConfigError, match="kernels=offload sets it") as e:
        cuda_graphs_decision(cfg)
    assert "cpu_offload_checkpointing" in str(e.value)
    without = "kernels.set='auto,-activation_offload'"
    cfg = compose("+dataset=mychar", "memory=vram24", offloaded, "kernels.cuda_graphs=true", without)
    with pytest.raises(ConfigError) as e:
        cuda_graphs_decision(cfg)
    assert "kernels=offload" not in str(e.value)  # taken out, not asked for


def test_a_setting_that_is_not_auto_true_or_false_is_refused(compose):
    with pytest.raises(ConfigError, match="choose auto, true or false"):
        cuda_graphs_decision(compose("+dataset=mychar", "kernels.cuda_graphs=sometimes"))


def fake_kernels(monkeypatch, installed, skipped=None):
    """registry.select / patch.apply_kernels stand-ins: record the options compile_blocks gets."""
    from flux_kernels.patches import patch
    from flux_kernels.runtime import registry

    seen = {}

    def apply(unet, selection, options, seconds):
        seen.update(options)
        seconds.update({name: 0.1 for name in selection.installed})
        return list(selection.installed)

    selection = registry.Selection(tuple(installed), skipped or {}, seconds={"compile_blocks": 0.4, "attention": 0.01})
    monkeypatch.setattr(registry, "select", lambda *a, **k: selection)
    monkeypatch.setattr(patch, "apply_kernels", apply)
    return seen


def test_graphs_compile_the_blocks_in_reduce_overhead_mode(monkeypatch, caplog):
    import torch

    # torch.compile's mode="reduce-overhead" is these inductor options, others could join (a mode cannot)
    assert torch._inductor.list_mode_options("reduce-overhead") == kernel_install.CUDA_GRAPHS_OPTIONS
    seen = fake_kernels(monkeypatch, ("attention", "compile_blocks"))
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):
        got = hooks_mod.install_kernels(None, {"set": "auto", "cuda_graphs": True}, "cuda")
    assert got == ["attention", "compile_blocks", "cuda_graphs"]
    line = "kernels: probes 0.4 s (compile_blocks 0.4 s); installing 0.2 s (compile_blocks 0.1 s, attention 0.1 s)"
    assert line in caplog.text  # the start-up they cost
    assert seen["compile_blocks"] == {"options": {"triton.cudagraphs": True}}
    assert seen["activation_offload"] == {"graphs": True}  # its copies wait for nothing the replays do otherwise
    seen = fake_kernels(monkeypatch, ("attention", "compile_blocks"))
    got = hooks_mod.install_kernels(None, {"set": "auto", "cuda_graphs": False}, "cuda")
    assert got == ["attention", "compile_blocks"]
    assert "compile_blocks" not in seen and "activation_offload" not in seen


def test_every_step_starts_a_new_graph_generation_and_skips_are_reported(tmp_path, monkeypatch, caplog):
    import torch
    from torch._dynamo.utils import counters

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", 0)
    caplog.set_level(logging.INFO, logger="flux_trainer.runner")
    h = hooks_mod.RunHooks(SimpleNamespace(kernels={}, metrics={}), tmp_path)
    h.step_start()
    assert marks == []  # no graphs installed: nothing marked
    h.kernels_installed = ["compile_blocks", "cuda_graphs"]
    for step in (1, 2, 3):
        h.step_start()
        h.step_end(None, {}, step)
    assert len(marks) == 3
    assert "every compiled block replays from CUDA graphs" in caplog.text
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", 2)
    caplog.clear()
    h.step_end(None, {}, 4)
    assert "CUDA graph" not in caplog.text  # said once, after this process's third step
    resumed = hooks_mod.RunHooks(SimpleNamespace(kernels={}, metrics={}), tmp_path)
    resumed.kernels_installed = ["compile_blocks", "cuda_graphs"]
    for step in (101, 102, 103):  # a run resumed at step 100: its third step here is the one recorded by then
        resumed.step_start()
        resumed.step_end(None, {}, step)
    assert "2 compiled graph(s) run without them" in caplog.text


def test_compile_cache_outcomes_are_reported_after_the_first_step(tmp_path, monkeypatch, caplog):
    from torch._dynamo.utils import counters

    for group, key, n in (
        ("inductor", "fxgraph_cache_hit", 5),
        ("inductor", "fxgraph_cache_miss", 2),
        ("inductor", "fxgraph_cache_bypass", 0),
        ("aot_autograd", "autograd_cache_hit", 3),
        ("aot_autograd", "autograd_cache_miss", 1),
        ("aot_autograd", "autograd_cache_bypass", 0),
    ):
        monkeypatch.setitem(counters[group], key, n)
    # torch's compile time so far: 12.5 s, and 20 s once a later step has compiled more (below)
    monkeypatch.setattr(
        compile_report, "compile_seconds", lambda: 20.0 if counters["inductor"]["fxgraph_cache_hit"] > 5 else 12.5
    )
    monkeypatch.setattr(compile_report, "compile_phases", dict)  # torch's phase timers: none here (test below)
    caplog.set_level(logging.INFO, logger="flux_trainer.runner")
    h = hooks_mod.RunHooks(SimpleNamespace(kernels={}, metrics={"enabled": False}), tmp_path)
    h.kernels_installed = ["compile_blocks"]
    h.step_end(None, {}, 101)  # this process's first step, in a run resumed at step 100
    assert (
        "torch.compile cache: inductor 5 hit / 2 miss / 0 bypass, autograd 3 hit / 1 miss / 0 bypass; 12.5 s compiling"
        in caplog.text
    )
    assert "WARNING" not in caplog.text
    caplog.clear()
    h.step_end(None, {}, 102)
    assert "torch.compile" not in caplog.text  # a later step that compiled nothing says nothing
    monkeypatch.setitem(counters["inductor"], "fxgraph_cache_hit", 7)  # a later step compiles two graphs more
    monkeypatch.setitem(counters["aot_autograd"], "autograd_cache_hit", 4)
    step = 103
    h.step_end(None, {}, step)
    assert (
        f"torch.compile at step {step}, compiled again: cache: inductor 2 hit / 0 miss / 0 bypass, autograd 1 hit / "
        "0 miss / 0 bypass; 7.5 s compiling"
    ) in caplog.text
    caplog.clear()
    monkeypatch.setitem(counters["aot_autograd"], "autograd_cache_bypass", 4)
    h.step_end(None, {}, step + 1)
    assert "autograd 0 hit / 0 miss / 4 bypass; 0.0 s" in caplog.text and "TORCH_LOGS=aot,inductor" in caplog.text
    assert caplog.records[-1].levelname == "WARNING"


def test_first_step_compiling_is_its_own_with_torch_phases(tmp_path, monkeypatch, caplog):
    """The first step's line counts what that step compiled, not the registry's compile probe before training
    (named apart), and says where its seconds went, from torch's phase timers."""
    from torch._dynamo.utils import counters

    state = {"seconds": 0.4, "phases": {"tracing": 0.1, "cache keys": 0.0}}  # the probe's tiny graph, compiled cold
    for group, key, n in (("inductor", "fxgraph_cache_hit", 2), ("aot_autograd", "autograd_cache_hit", 1)):
        monkeypatch.setitem(counters[group], key, n)
    for group, kind in (("inductor", "fxgraph_cache"), ("aot_autograd", "autograd_cache")):
        for outcome in ("miss", "bypass"):  # whatever tests before this one compiled in this process
            monkeypatch.setitem(counters[group], f"{kind}_{outcome}", 0)
    monkeypatch.setattr(compile_report, "compile_seconds", lambda: state["seconds"])
    monkeypatch.setattr(compile_report, "compile_phases", lambda: dict(state["phases"]))
    caplog.set_level(logging.INFO, logger="flux_trainer.runner")
    h = hooks_mod.RunHooks(SimpleNamespace(kernels={}, metrics={"enabled": False}), tmp_path)
    h.kernels_installed = ["compile_blocks"]
    h.step_start()  # training starts: what was compiled so far is the probe's
    monkeypatch.setitem(counters["inductor"], "fxgraph_cache_hit", 6)  # the first step: two block graphs from cache
    monkeypatch.setitem(counters["aot_autograd"], "autograd_cache_hit", 3)
    state["seconds"] = 4.0
    state["phases"] = {"tracing": 1.5, "loading cached code": 1.6, "cache keys": 0.36, "guards": 0.02}
    h.step_end(None, {}, hooks_mod.COMPILE_CHECKED_AT)
    assert (
        "torch.compile cache: inductor 4 hit / 0 miss / 0 bypass, autograd 2 hit / 0 miss / 0 bypass; 3.6 s compiling "
        "(tracing 1.4 s, loading cached code 1.6 s, cache keys 0.4 s, other 0.2 s); before training 1 graph(s), 0.4 s "
        "(kernel probes)"
    ) in caplog.text
    assert h._compile_cache.startswith("torch.compile cache: inductor 4 hit")


def test_compile_phases_are_read_from_torch(monkeypatch):
    """compile_phases sums torch's own per-call timers into the phases shown, and a torch that timed nothing gives
    zeros rather than an error."""
    from torch._dynamo import utils

    timed = {"bytecode_tracing": [0.5, 0.25], "CacheBase.get_system.triton_key": [0.2]}
    monkeypatch.setattr(utils, "compilation_time_metrics", {**timed, "inductor_codecache_torch_key": [0.1]})
    phases = compile_report.compile_phases()
    assert phases["tracing"] == 0.75 and abs(phases["cache keys"] - 0.3) < 1e-9 and phases["compiling"] == 0.0
    assert set(phases) == {name for name, _ in compile_report.COMPILE_PHASES}


def test_cache_bypass_reasons_come_from_torch_itself(tmp_path, monkeypatch, caplog, torch_config):
    """A graph that cannot be cached (a plain-function custom pass makes inductor bypass its FX graph cache):
    torch's own reason reaches the run log, and torch's INFO record, which the user did not ask for, is dropped."""
    import torch
    from torch._dynamo.utils import counters

    torch_config(torch._inductor.config, fx_graph_cache=True, post_grad_custom_post_pass=lambda graph: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    codecache_log = logging.getLogger("torch._inductor.codecache")
    level_before = codecache_log.level
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    catch = Catch(level=logging.DEBUG)
    codecache_log.addHandler(catch)
    reasons = compile_report.CacheBypassReasons().install()
    with undoing(reasons.remove, lambda: codecache_log.removeHandler(catch), torch._dynamo.reset):
        torch._dynamo.reset()
        bypassed = counters["inductor"]["fxgraph_cache_bypass"]
        f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
        f(torch.randn(8, 5))
        assert counters["inductor"]["fxgraph_cache_bypass"] > bypassed
    assert codecache_log.level == level_before
    assert reasons.reasons == {
        "inductor: Unsupported post grad custom pass": 1,
        "autograd: Unsupported post grad custom pass": 1,
    }
    assert not any(m.startswith("Bypassing") for m in seen)  # below the logger's own level: not shown

    monkeypatch.setitem(counters["inductor"], "fxgraph_cache_bypass", 1)
    caplog.set_level(logging.INFO, logger="flux_trainer.runner")
    compile_report.report_compile_cache(reasons.reasons)
    assert "torch says: " in caplog.text and "inductor: Unsupported post grad custom pass (1x)" in caplog.text
    assert "TORCH_LOGS" not in caplog.text


def test_graphs_over_swapped_blocks_need_block_swap_installed(monkeypatch, caplog):
    """sd-scripts' own swap (block_swap not installed) moves the weights a graph reads: the graphs are left out with
    a line under auto, an error where they were asked for; with block_swap they are installed."""
    from types import SimpleNamespace

    from flux_kernels.runtime.errors import KernelError

    swapping = SimpleNamespace(blocks_to_swap=4)
    fake_kernels(monkeypatch, ("compile_blocks", "block_swap"))
    got = hooks_mod.install_kernels(swapping, {"set": "auto", "cuda_graphs": True}, "cuda")
    assert got == ["compile_blocks", "block_swap", "cuda_graphs"]
    seen = fake_kernels(monkeypatch, ("compile_blocks",), {"block_swap": "page-locked memory failed"})
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):
        got = hooks_mod.install_kernels(swapping, {"set": "auto", "cuda_graphs": True}, "cuda")
    assert got == ["compile_blocks"] and "compile_blocks" not in seen
    assert "cuda graphs skipped: the model swaps blocks without the block_swap kernel (page-locked" in caplog.text
    with pytest.raises(KernelError, match="sd-scripts' swap moves the weights"):
        hooks_mod.install_kernels(swapping, {"set": "auto", "cuda_graphs": True, "cuda_graphs_asked": True}, "cuda")


def test_the_header_says_when_samples_leave_the_graphs_off(compose):
    """Only where the graphs would replay but for the samples on a swapping tier: a slower step the user did not ask
    for is said before the run starts, with the key that keeps them."""
    from flux_trainer.plan import cuda_graphs_note

    prompts = "sample.prompts=[a red square]"
    note = cuda_graphs_note(compose("+dataset=mychar", "memory=vram16", prompts))
    assert note.startswith("CUDA graphs off (a slower step): sample.prompts on memory=vram16, which swaps blocks")
    assert "kernels.cuda_graphs=true keeps them" in note
    for overrides in (
        ["memory=vram16"],  # no samples: the graphs replay
        ["memory=vram24", prompts],  # nothing swapped: samples change nothing
        ["memory=vram8", prompts],  # off there anyway (memory.cuda_graphs=false)
        ["memory=vram16", prompts, "kernels.cuda_graphs=true"],  # kept by the user
        ["memory=vram16", prompts, "kernels.cuda_graphs=false"],
    ):
        assert cuda_graphs_note(compose("+dataset=mychar", *overrides)) is None, overrides
    assert cuda_graphs_note(compose("+dataset=mychar", "memory=vram16", prompts), gpu=False) is None
