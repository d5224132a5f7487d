"""Regional torch.compile of musubi-tuner's FLUX.2 and Kontext transformers, verified before it is installed.

The same idea as flux_kernels' `compile_blocks` for sd-scripts' FLUX.1 model: every double and single block compiled
in place (`block.compile()`: the module tree, its names and the LoRA hooks stay as they are; one graph per block kind,
since the blocks of a kind share their code), the transformer's own Python loop around them left alone. musubi-tuner
can do this itself (`--compile`, musubi_tuner.utils.model_utils.compile_transformer), but only from its TOML, and the
bench runs plain musubi-tuner on our very TOMLs: so the runner installs it (kernel_install.py), not the TOML.

Before anything is installed, `probe_block` runs one block of each kind compiled against the same block uncompiled
on fresh random inputs at the model's real width (a few tokens), forward and backward (the gradients of the inputs
and of the LoRA weights), under the run's autocast, in the block's training mode (so through its gradient
checkpointing); it installs only if every tensor agrees within the dtype's tolerance. The probe's graphs are compiled
with static shapes and dropped afterwards (`torch._dynamo.reset`), so the training graphs start from the run's
first real shape. With block swap the blocks' Linear layers stay out of the graphs, as musubi-tuner's own compile
does (their weights move between devices; musubi_tuner.utils.model_utils.disable_linear_from_compile, imported from
the checkout).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

# max |compiled - eager| / max |eager| allowed per tensor, as flux_kernels.patches.verify checks whole FLUX blocks
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4}
IMG_TOKENS, TXT_TOKENS = 12, 5  # the probe's sequence: a few tokens at the real width
CXX = ("g++", "c++", "clang++")  # what inductor's CPU backend compiles its code with


@dataclass(frozen=True)
class BlockProbe:
    """One block kind's verdict: ok, why (a line for the log), and the worst relative error seen."""

    kind: str
    ok: bool
    why: str
    worst: float = 0.0


def compiler_available(device: torch.device) -> tuple[bool, str]:
    """Whether inductor can build code for this device: triton for a GPU, a C++ compiler for the CPU."""
    if not hasattr(nn.Module, "compile"):
        return False, f"torch {torch.__version__} has no nn.Module.compile (needs 2.2+)"
    if device.type == "cuda":
        from flux_kernels.runtime.device import triton_available

        return (True, "triton") if triton_available() else (False, "inductor's GPU backend needs triton")
    if device.type == "cpu":
        found = next((c for c in CXX if shutil.which(c)), None)
        return (True, found) if found else (False, f"inductor's CPU backend needs a C++ compiler ({', '.join(CXX)})")
    return False, f"no inductor backend checked for {device.type}"


def blocks_of(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The double and single blocks of musubi-tuner's Flux2 / Flux (both name them so)."""
    return list(getattr(model, "double_blocks", [])), list(getattr(model, "single_blocks", []))


def is_flux2(model: nn.Module) -> bool:
    return type(model).__module__.rsplit(".", 1)[-1] == "flux2_models"


def rope_table(model: nn.Module, n: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """RoPE of `n` random positions through the model's own embedder (the table the blocks get in training)."""
    axes = len(model.pe_embedder.axes_dim)
    ids = torch.randint(0, 16, (1, n, axes), generator=gen).to(device, torch.float32)
    return model.pe_embedder(ids)


def example_inputs(
    model: nn.Module, kind: str, device: torch.device, dtype: torch.dtype, seed: int
) -> tuple[tuple, dict[str, Any]]:
    """Fresh random (args, kwargs) for one block of `kind` ("double" / "single"), as the model's forward calls it:
    activations that need grad in `dtype`, small modulations, the model's RoPE table."""
    gen = torch.Generator().manual_seed(seed)
    hidden = int(model.hidden_size)

    def act(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    li, lt = IMG_TOKENS, TXT_TOKENS
    if is_flux2(model):
        params = sys.modules[type(model).__module__].AttentionParams
        attn = params.create_attention_params(model.attn_mode, model.split_attn)

        def mod() -> tuple[Tensor, Tensor, Tensor]:
            return act(1, 1, hidden, scale=0.1), act(1, 1, hidden, scale=0.1), act(1, 1, hidden, scale=0.5)

        pe_x, pe_ctx = rope_table(model, li, gen, device), rope_table(model, lt, gen, device)
        if kind == "double":
            args = (act(1, li, hidden), act(1, lt, hidden), pe_x, pe_ctx, (mod(), mod()), (mod(), mod()), attn)
            return args, {}
        return (act(1, lt + li, hidden), torch.cat((pe_ctx, pe_x), dim=2), mod(), attn), {}
    pe = rope_table(model, lt + li, gen, device)
    vec = act(1, hidden)
    if kind == "double":
        return (), {"img": act(1, li, hidden), "txt": act(1, lt, hidden), "vec": vec, "pe": pe, "control_lengths": None}
    return (act(1, lt + li, hidden),), {"vec": vec, "pe": pe, "control_lengths": None}


def _run(
    fn: Callable, args: tuple, kwargs: dict, params: list[Tensor], amp: Callable[[], Any], seed: int
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Outputs, and the gradients of every input and LoRA weight for one fixed random upstream gradient (through
    torch.autograd.grad: nothing lands in the weights' .grad)."""
    torch.manual_seed(seed)
    with torch.enable_grad(), amp():
        outs = [t for t in tree_flatten(fn(*args, **kwargs))[0] if isinstance(t, Tensor)]
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves + params, upstream, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def _rel_err(got: Tensor, want: Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


@contextlib.contextmanager
def lora_eval(modules: Iterable[nn.Module]):
    """The LoRA modules in eval mode for the probe (a LoRA's dropout draws random numbers, which eager and inductor
    draw differently), their training flags put back after."""
    held = [(m, m.training) for m in modules]
    for m, _ in held:
        m.training = False
    try:
        yield
    finally:
        for m, was in held:
            m.training = was


def probe_block(
    block: nn.Module,
    inputs: Callable[[int], tuple[tuple, dict]],
    params: list[Tensor],
    dtype: torch.dtype,
    amp: Callable[[], Any] = contextlib.nullcontext,
    kind: str = "block",
) -> BlockProbe:
    """`block` compiled (a separate torch.compile wrapper; the block itself is not changed) against `block` eager on
    the same fresh random inputs, forward and backward, each under a fresh `amp()` (the run's autocast). A compile or
    run that fails is a failed probe with its error's first line."""
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    name = str(dtype).removeprefix("torch.")
    try:
        args, kwargs = inputs(1)
        want, dwant = _run(block, args, kwargs, params, amp, seed=2)
        compiled = torch.compile(block, dynamic=False)
        got, dgot = _run(compiled, args, kwargs, params, amp, seed=2)
    except Exception as exc:  # noqa: BLE001 - a block that cannot compile or run compiled is not installed
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        return BlockProbe(kind, False, f"{kind} block: compiling failed: {type(exc).__name__}: {first}")
    if (len(got), len(dgot)) != (len(want), len(dwant)):
        return BlockProbe(kind, False, f"{kind} block: compiled gives {len(got)} outputs, eager {len(want)}")
    pairs = [("output", i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True))]
    pairs += [("gradient", i, g, w) for i, (g, w) in enumerate(zip(dgot, dwant, strict=True))]
    worst = 0.0
    for what, i, g, w in pairs:
        if g is None and w is None:
            continue  # a LoRA weight of another block
        if g is None or w is None:
            only = "eager" if g is None else "compiled"
            return BlockProbe(kind, False, f"{kind} block: {what} {i} exists only {only}")
        err = _rel_err(g, w)
        worst = max(worst, err) if err == err else float("nan")
        if not err <= tol:
            why = f"{kind} block: {name} {what} {i} differs from the eager block (max rel. error {err:.2e} > {tol:.0e})"
            return BlockProbe(kind, False, why, err)
    return BlockProbe(kind, True, f"{kind} block matches eager, fwd+bwd ({name}, max rel. error {worst:.1e})", worst)


def disable_swapped_linears(blocks: list[nn.Module], musubi_model_utils: Any) -> Callable[[], None]:
    """With block swap, the blocks' Linear layers run outside the graphs, through musubi-tuner's own function (as
    its --compile does); returns what undoes it."""
    for b in blocks:
        musubi_model_utils.disable_linear_from_compile(b)

    def undo() -> None:
        for b in blocks:
            for m in b.modules():
                if hasattr(m, "_forward_before_disable_compile"):
                    m.forward = m._forward_before_disable_compile

    return undo


def compile_in_place(
    blocks: list[nn.Module], hold: Callable[[], contextlib.AbstractContextManager] | None = None, **opts: Any
) -> None:
    """`block.compile(**opts)` on each: compiled at its first call, the module itself kept (names, hooks, swap).
    `hold`: a context entered around every compiled call, looked up at each call (the attention dispatch's
    `compiled_context`: the SDPA backend chosen at the run's first forward, which the traced code then calls, as
    flux_kernels' compile_blocks holds it around sd-scripts' blocks)."""
    for b in blocks:
        b.compile(**opts)
        if hold is not None:
            _hold(b, hold)


def _hold(block: nn.Module, hold: Callable[[], contextlib.AbstractContextManager]) -> None:
    compiled = block._compiled_call_impl

    def call(*args, **kwargs):
        with hold():
            return compiled(*args, **kwargs)

    block._compiled_call_impl = call


def uncompile(blocks: list[nn.Module]) -> int:
    """Undo `compile_in_place`; the number of blocks that were compiled."""
    n = 0
    for b in blocks:
        if getattr(b, "_compiled_call_impl", None) is not None:
            b._compiled_call_impl = None
            n += 1
    return n
