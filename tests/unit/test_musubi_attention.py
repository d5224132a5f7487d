"""The `attention` kernel on musubi-tuner's models (flux_trainer/musubi/attention.py): flux_kernels' measured backend in
the plain self-attention of FLUX.2's and Kontext's blocks, on musubi-tuner's real classes at the tiny presets' widths
(random_flux2_klein_tiny, random_kontext_tiny; eager, CPU). The patched model gives musubi-tuner's outputs and
gradients; split attention, masks, variable lengths and unequal reference lengths go to musubi-tuner's function; a
verification that fails is one line under auto and a KernelError (exit 2) when named; the compiled blocks trace ours
in one graph and run inside the SDPA backend chosen at the first training forward."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flux_trainer.musubi import attention as ma
from flux_trainer.musubi import block_compile as bc
from flux_trainer.musubi.checkout import import_module
from tests.conftest import undoing
from tests.musubi_checkout import MUSUBI, FakeAccelerator, need_musubi


def tiny_kontext() -> nn.Module:
    from flux_trainer.config.random_specs import PRESETS

    m = import_module(MUSUBI.path, "flux.flux_models")
    torch.manual_seed(0)
    return m.Flux(m.FluxParams(**PRESETS["tiny"]["flux"], theta=10000, qkv_bias=True), attn_mode="torch")


def tiny_flux2() -> nn.Module:
    from flux_trainer.musubi.random_specs import FLUX2_PRESETS

    m = import_module(MUSUBI.path, "flux_2.flux2_models")
    torch.manual_seed(0)
    params = dataclasses.replace(m.Klein4BParams(), **FLUX2_PRESETS["random_flux2_klein_tiny"]["dit"])
    return m.Flux2(params, attn_mode="torch")


def model_inputs(model: nn.Module, img: int = 6, txt: int = 4) -> dict:
    """A training call of the whole transformer: B=1, `img` image and `txt` text tokens, inputs needing grad."""
    gen = torch.Generator().manual_seed(1)

    def t(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    if ma.kind(model) == "kontext":
        p = model.params
        ids = torch.randint(0, 8, (1, img, 3), generator=gen).float()
        return {"img": t(1, img, p.in_channels), "img_ids": ids, "txt": t(1, txt, p.context_in_dim),
                "txt_ids": torch.zeros(1, txt, 3), "timesteps": torch.tensor([0.4]), "y": t(1, p.vec_in_dim),
                "guidance": torch.tensor([1.0]), "control_lengths": [2]}  # fmt: skip
    axes = len(model.pe_embedder.axes_dim)
    return {"x": t(1, img, model.in_channels), "x_ids": torch.randint(0, 8, (1, img, axes), generator=gen).float(),
            "timesteps": torch.tensor([0.4]), "ctx": t(1, txt, model.txt_in.in_features),
            "ctx_ids": torch.randint(0, 8, (1, txt, axes), generator=gen).float(), "guidance": None}  # fmt: skip


def forward_backward(model: nn.Module, inputs: dict) -> list[torch.Tensor]:
    """The output and the gradients of every input and weight, for one fixed upstream gradient."""
    out = model(**inputs)
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    leaves += [p for p in model.parameters() if p.requires_grad]
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    return [out.detach(), *torch.autograd.grad(out, leaves, upstream, allow_unused=True)]


class Counted:
    """A backend's run that counts its calls (the probe's and the blocks')."""

    def __init__(self, run) -> None:
        self.run, self.calls = run, 0

    def __call__(self, q, k, v, mask):
        self.calls += 1
        return self.run(q, k, v, mask)


def math_dispatch(tmp_path, scale: float = 1.0):
    """An AttentionDispatch on the CPU whose one backend is SDPA's math (counted; `scale` != 1 makes it wrong)."""
    from flux_kernels.patches.attention.backends import BACKENDS
    from flux_kernels.patches.attention.dispatch import AttentionDispatch

    counted = Counted(lambda q, k, v, mask: BACKENDS["sdpa_math"].run(q, k, v, mask) * scale)
    backends = {"sdpa_math": dataclasses.replace(BACKENDS["sdpa_math"], run=counted)}
    dispatch = AttentionDispatch(cache_path=tmp_path / "probe.json", backends=backends, device="cpu")
    return dispatch, counted


@pytest.fixture(autouse=True)
def _put_back():
    """musubi-tuner's own functions back in its modules after each test (install changes a module global)."""
    yield
    if MUSUBI is not None:
        for name in ("flux.flux_models", "flux_2.flux2_models"):
            module = import_module(MUSUBI.path, name)
            module.attention = getattr(module.attention, ma.ORIGINAL, module.attention)


@pytest.mark.parametrize("build", [tiny_kontext, tiny_flux2], ids=["kontext", "flux2"])
def test_the_patched_model_gives_musubi_tuners_outputs_and_gradients(build, tmp_path):
    need_musubi()
    model = build()
    inputs = model_inputs(model)
    want = forward_backward(model, inputs)
    dispatch, counted = math_dispatch(tmp_path)
    ok, line = ma.install(model, dispatch, torch.device("cpu"), torch.float32)
    assert ok, line
    assert line.startswith("matches musubi-tuner's attention, fwd+bwd (float32, max rel. error")
    module = ma.installed(model).module
    assert getattr(module.attention, ma.ORIGINAL) is not None  # what the blocks look up at each call is ours

    got = forward_backward(model, inputs)  # the first training forward decides the run's backend
    heads = int(model.num_heads)
    assert dispatch.run_choice == "sdpa_math"
    assert dispatch.run_line == f"sdpa_math at (1, {heads}, 10, {model.hidden_size // heads}) float32 mask=False"
    counted.calls = 0
    got = forward_backward(model, inputs)
    assert counted.calls == 2  # one double and one single block, both through the dispatch
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, i
            continue
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-5, (i, err)
    assert ma.remove(model) and ma.installed(model) is None
    assert not hasattr(module.attention, ma.ORIGINAL)  # musubi-tuner's own function is back


def test_no_decision_without_grad_and_the_decision_is_made_once(tmp_path):
    """A sample rendered before training (no grad) decides nothing; the first training forward decides, once."""
    need_musubi()
    model = tiny_kontext()
    dispatch, _ = math_dispatch(tmp_path)
    assert ma.install(model, dispatch, torch.device("cpu"), torch.float32)[0]
    with torch.no_grad():
        model(**model_inputs(model, img=3))
    assert dispatch.run_choice is None
    forward_backward(model, model_inputs(model))
    line = dispatch.run_line
    forward_backward(model, model_inputs(model, img=8))
    assert dispatch.run_line == line and "(1, 2, 10, 128)" in line


def spies():
    """(dispatch, original, calls): stand-ins that record which path a call took."""
    calls = []
    dispatch = SimpleNamespace(tokens=lambda q, k, v: calls.append("dispatch") or F.scaled_dot_product_attention(
        q, k, v).transpose(1, 2).flatten(2))  # fmt: skip

    def original(*args, **kwargs):
        calls.append("original")
        return "theirs"

    return dispatch, original, calls


def qkv(heads: int = 2, kv_heads: int = 2, length: int = 5, batch: int = 2):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, heads, length, 8, generator=gen)
    k, v = (torch.randn(batch, kv_heads, length, 8, generator=gen) for _ in range(2))
    return q, k, v


def identity_rope(q, k, pe):
    return q, k


def test_kontexts_split_attention_mask_and_unequal_reference_lengths_go_to_musubi_tuners_function():
    dispatch, original, calls = spies()
    attention = ma.kontext_attention(dispatch, original, identity_rope)
    q, k, v = qkv()
    for kwargs in ({"split_attn": True}, {"control_lengths": [2, 3]}, {"attn_mask": torch.ones(2, 5, dtype=bool)}):
        calls.clear()
        assert attention(q, k, v, None, **kwargs) == "theirs" and calls == ["original"], kwargs
    calls.clear()
    out = attention(q, k, v, None, control_lengths=[3, 3], attn_mode="xformers")  # plain: ours, whatever the mode
    assert calls == ["dispatch"] and out.shape == (2, 5, 16)


def test_flux2s_masks_split_and_variable_lengths_go_to_musubi_tuners_function():
    need_musubi()
    m = import_module(MUSUBI.path, "flux_2.flux2_models")
    dispatch, original, calls = spies()
    attention = ma.flux2_attention(dispatch, original, identity_rope)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    not_plain = {
        "split": m.AttentionParams.create_attention_params("torch", True),
        "mask": m.AttentionParams.create_attention_params_from_mask("torch", False, 2, mask),
        "mask, split": m.AttentionParams.create_attention_params_from_mask("torch", True, 2, mask),
    }
    for what, params in not_plain.items():
        calls.clear()
        assert attention(list(qkv()), None, params) == "theirs" and calls == ["original"], what
    calls.clear()  # fewer key than query heads (grouped-query attention): musubi-tuner's repeat
    assert attention(list(qkv(heads=4, kv_heads=2)), None, not_plain["split"]) == "theirs"
    plain = m.AttentionParams.create_attention_params("torch", False)
    assert attention(list(qkv(heads=4, kv_heads=2)), None, plain) == "theirs" and calls == ["original", "original"]
    calls.clear()
    listed = list(qkv())
    out = attention(listed, None, plain)
    assert calls == ["dispatch"] and out.shape == (2, 5, 16) and listed == []  # the list emptied, as musubi-tuner's


def test_split_attn_on_the_model_is_refused_before_anything_changes(tmp_path):
    need_musubi()
    model = tiny_flux2()
    model.split_attn = True
    dispatch, _ = math_dispatch(tmp_path)
    ok, why = ma.install(model, dispatch, torch.device("cpu"), torch.float32)
    assert not ok and why.startswith("split_attn is set") and ma.installed(model) is None


def test_a_wrong_attention_fails_the_verification_and_changes_nothing():
    """A dispatch whose tokens are 1% off (the probe guards each backend; this is what the install guards: our
    function as a whole, RoPE and layouts included, against musubi-tuner's)."""
    need_musubi()
    model = tiny_kontext()
    module = import_module(MUSUBI.path, "flux.flux_models")
    theirs = module.attention

    class Wrong:
        run_choice = None

        def tokens(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2) * 1.01

    ok, why = ma.install(model, Wrong(), torch.device("cpu"), torch.float32)
    assert not ok and why.startswith("float32 output differs from musubi-tuner's attention (max rel. error 1.0"), why
    assert module.attention is theirs and ma.installed(model) is None


def install_kernels(model: nn.Module, kernel_set: str, accelerator=None) -> list[str]:
    from flux_trainer.musubi.kernel_install import install_kernels

    args = SimpleNamespace(compile=False, mixed_precision="no")
    trainer = SimpleNamespace(blocks_to_swap=0)
    return install_kernels(trainer, args, accelerator or FakeAccelerator(), None, model, {"set": kernel_set})


def test_named_on_the_cpu_installs_it_and_auto_on_the_cpu_skips_it_with_one_line(caplog, monkeypatch, tmp_path):
    need_musubi()
    from flux_trainer.musubi import kernel_install

    monkeypatch.setattr(kernel_install, "new_dispatch", lambda device: math_dispatch(tmp_path)[0])
    model = tiny_kontext()
    with caplog.at_level("INFO"):
        assert install_kernels(model, "auto,-compile_blocks") == []
    assert ("kernel attention skipped: auto chooses the attention backend on a CUDA GPU only (device is cpu); "
            "kernels.set=auto,attention installs it anyway") in caplog.text  # fmt: skip
    assert "training goes on with musubi-tuner's own attention" in caplog.text and ma.installed(model) is None
    caplog.clear()
    with caplog.at_level("INFO"):
        assert install_kernels(model, "attention") == ["attention"]
    assert "kernels: installing attention: musubi_tuner.flux.flux_models.attention in its plain self-attention " in (
        caplog.text
    )
    assert "kernels: attention\n" in caplog.text + "\n" and ma.installed(model) is not None
    assert install_kernels(tiny_kontext(), "off") == []


def test_a_failed_verification_is_one_line_under_auto_and_stops_a_named_run(caplog, monkeypatch, tmp_path):
    need_musubi()
    from flux_kernels.runtime.errors import KernelError
    from flux_trainer.musubi import kernel_install

    why = "bfloat16 dq differs from musubi-tuner's attention (max rel. error 3.1e-01 > 5e-02)"
    monkeypatch.setattr(ma, "verify", lambda *a: (False, why))
    monkeypatch.setattr(kernel_install, "new_dispatch", lambda device: math_dispatch(tmp_path)[0])
    model = tiny_kontext()
    theirs = import_module(MUSUBI.path, "flux.flux_models").attention
    with pytest.raises(KernelError) as exc:  # named (on the CPU too): the run stops (the runner's exit code 2)
        install_kernels(model, "attention")
    assert str(exc.value) == f"attention cannot be installed: {why}; use kernels=auto or kernels=off"
    assert ma.installed(model) is None and import_module(MUSUBI.path, "flux.flux_models").attention is theirs
    # auto tries it on a CUDA GPU only: an accelerator that says it is one, and the install's verdict as above
    monkeypatch.setattr(kernel_install, "install_attention", lambda *a: (False, why))
    with caplog.at_level("INFO"):
        assert install_kernels(model, "auto,-compile_blocks", FakeAccelerator("cuda")) == []
    (line,) = [r.getMessage() for r in caplog.records if "kernel attention" in r.getMessage()]
    assert line == f"kernel attention skipped: {why}; training goes on with musubi-tuner's own attention"


@pytest.mark.parametrize("build", [tiny_kontext, tiny_flux2], ids=["kontext", "flux2"])
def test_compiled_blocks_trace_ours_in_one_graph_inside_the_run_backend(build, tmp_path):
    """The compiled blocks call the dispatch's compiled path (one graph: fullgraph), and every compiled call runs
    inside the backend chosen at the first training forward (compiled_context, held as compile_blocks holds it)."""
    need_musubi()
    model = build()
    dispatch, _ = math_dispatch(tmp_path)
    assert ma.install(model, dispatch, torch.device("cpu"), torch.float32)[0]
    inputs = model_inputs(model)
    want = forward_backward(model, inputs)  # eager; decides the run's backend
    held = []
    context = dispatch.compiled_context
    dispatch.compiled_context = lambda: held.append(dispatch.run_choice) or context()
    double, single = bc.blocks_of(model)
    bc.compile_in_place(double + single, hold=dispatch.compiled_context, backend="aot_eager", fullgraph=True)
    with undoing(lambda: bc.uncompile(double + single), torch._dynamo.reset):
        got = forward_backward(model, inputs)
    assert held == ["sdpa_math", "sdpa_math"]
    for g, w in zip(got, want, strict=True):
        if w is not None:
            assert ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() < 1e-5
