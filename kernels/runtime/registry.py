"""The kernel registry: one frozen record per kernel (where it applies, how to install it, the reference and the
fast op), a probe that runs both on tiny random inputs on this device, and `select` that turns the user's
`kernels=` setting into what gets installed.

    auto      every kernel marked `in_auto` that applies here and passes its probe; the others are skipped
              with one log line each (and the reason kept in `Selection.skipped`)
    off       nothing
    [names]   exactly these; one that does not apply or fails its probe is an error naming why
    auto,a,-b auto's kernels plus `a` (insisted on, as above) without `b` (flux_kernels.runtime.request)
Installed in registry order whatever the order asked (compile_blocks after the patches, so it compiles them,
activation_offload after it, since it wraps the compiled calls, and block_swap last, since it copies the frozen
weights as the others left them).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from flux_kernels.memory import activation_offload, block_swap
from flux_kernels.memory import selective_checkpoint as sac
from flux_kernels.ops import adamw, coalesced_reduce, fast, prodigy, reference, single_process
from flux_kernels.patches import chroma, compile_blocks, fp8, lora_fold, lora_norms, patch, prologue, single_qkv
from flux_kernels.patches.attention.backends import SAGE_REASON
from flux_kernels.patches.attention.probe import chosen, probe_attention
from flux_kernels.runtime.applies import (
    any_applies,
    checkpoints_blocks,
    compile_applies,
    cuda_applies,
    fp8_applies,
    fp8_base_only,
    has_lora,
    has_wide_lora,
    several_processes,
    swaps_blocks,
    triton_applies,
)
from flux_kernels.runtime.device import DeviceInfo, as_device_info
from flux_kernels.runtime.errors import KernelError
from flux_kernels.runtime.examples import (
    chroma_example,
    double_qkv_example,
    fp8_example,
    gated_example,
    gated_modulate_example,
    lora_fold_example,
    lora_norms_example,
    modulate_example,
    offload_example,
    prologue_example,
    qk_example,
    sac_example,
    single_qkv_example,
)
from flux_kernels.runtime.request import KERNEL_NAMES, KernelRequest, parse_request

log = logging.getLogger(__name__)

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}  # max |fast - ref| / max |ref|
FP8_TOLERANCE = 6e-2  # e4m3 keeps 3 mantissa bits: one rounding of each operand gives ~2-3% here


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    applies: Callable[[Any], tuple[bool, str]]  # DeviceInfo | torch.device | dict -> (ok, reason)
    install: Callable[..., str]  # (model, **opts) -> one line saying what was patched
    reference: Callable | None = None
    fast: Callable | None = None
    example: Callable[[torch.device, torch.dtype], tuple] | None = None  # tiny random args for reference/fast
    check: Callable[[DeviceInfo], tuple[bool, str]] | None = None  # a probe of its own (attention, compile)
    in_auto: bool = True
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
    tolerance: float | None = None  # max rel. error allowed by the probe; None: TOLERANCE of the dtype
    auto_if: Callable[[Any], tuple[bool, str]] | None = None  # (model) -> (ok, reason): `auto` installs it only if ok
    # auto_if reads only what the model is before any kernel is installed (not what the kernels before it leave):
    # `select`, given the model, asks it first and probes nothing where auto would skip the kernel anyway
    auto_if_static: bool = False
    target: str = "model"  # what `install` takes: "model" (sd-scripts' FLUX model), "optimizer" or "trainer" (ours)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str
    max_err: float | None = None


@dataclass(frozen=True)
class Selection:
    installed: tuple[str, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)  # name -> why not
    device: DeviceInfo | None = None
    specs: tuple[KernelSpec, ...] = ()
    explicit: bool = False  # the user named exactly these kernels: failing to install them is an error, not a fallback
    named: tuple[str, ...] = ()  # with auto, the ones named besides it (auto,name), insisted on the same way
    seconds: Mapping[str, float] = field(default_factory=dict)  # name -> wall seconds its applies + probe took

    def insists(self, name: str) -> bool:
        """Whether failing to install `name` is an error (named by the user) rather than a fallback (auto's)."""
        return self.explicit or name in self.named

    def summary(self) -> str:
        skipped = "; ".join(f"{k} ({v})" for k, v in self.skipped.items())
        return f"kernels: {', '.join(self.installed) or 'none'}" + (f"; skipped: {skipped}" if skipped else "")

    def probe_time(self) -> str:
        """ "4.8 s (single_qkv 1.2 s, compile_blocks 0.4 s, ...)": the probes' wall time before training."""
        return seconds_by_name(self.seconds)


def seconds_by_name(seconds: Mapping[str, float]) -> str:
    """ "4.8 s (single_qkv 1.2 s, compile_blocks 0.4 s, ...)": the total, then the parts of at least 0.05 s, slowest
    first."""
    named = sorted(((t, n) for n, t in seconds.items() if t >= 0.05), reverse=True)
    parts = ", ".join(f"{n} {t:.1f} s" for t, n in named)
    return f"{sum(seconds.values()):.1f} s" + (f" ({parts})" if parts else "")


# ---- probe ------------------------------------------------------------------------------------------------------


def _outputs(result) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(result)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _run(fn: Callable, args: tuple, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs, and gradients of every input that requires grad for a fixed random upstream gradient."""
    with torch.enable_grad():
        outs = _outputs(fn(*args))
        wrt = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        gen = torch.Generator(device="cpu").manual_seed(seed)
        grads_out = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, wrt, grads_out, allow_unused=True) if wrt else ()
    return [o.detach() for o in outs], [g for g in grads if g is not None]


def probe(spec: KernelSpec, device=None) -> ProbeResult:
    """Run the fast op against the reference on tiny random inputs (never zero), forward and backward, in each of
    the spec's dtypes the device supports; the verdict names the worst error. Kernels without a reference/fast
    pair (attention choice, torch.compile) run their own `check`."""
    info = as_device_info(device)
    try:
        if spec.check is not None:
            ok, why = spec.check(info)
            return ProbeResult(ok, why)
        worst = 0.0
        for dtype in spec.dtypes:
            if dtype == torch.bfloat16 and not info.bf16:
                continue
            args = spec.example(info.torch_device, dtype)
            (want, dwant), (got, dgot) = _run(spec.reference, args, seed=1), _run(spec.fast, args, seed=1)
            if (len(want), len(dwant)) != (len(got), len(dgot)):
                return ProbeResult(False, f"{dtype}: fast gives {len(got)}+{len(dgot)} tensors, reference "
                                   f"{len(want)}+{len(dwant)} (outputs+gradients)")  # fmt: skip
            pairs = [("output", i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True))]
            pairs += [("gradient", i, g, w) for i, (g, w) in enumerate(zip(dgot, dwant, strict=True))]
            tol = spec.tolerance if spec.tolerance is not None else TOLERANCE[dtype]
            for what, i, g, w in pairs:
                err = reference.max_rel_err(g, w)
                worst = max(worst, err) if err == err else float("nan")
                if not err <= tol:
                    msg = f"{str(dtype).removeprefix('torch.')} {what} {i}: max rel. error {err:.2e}"
                    return ProbeResult(False, f"probe failed vs reference ({msg} > {tol:.0e})", err)
        return ProbeResult(True, "matches the reference (fwd+bwd)", worst)
    except Exception as e:  # noqa: BLE001 - a kernel that crashes in its probe is as unusable as a wrong one
        return ProbeResult(
            False, f"probe crashed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        )


# ---- checks for the kernels without a reference/fast pair ------------------------------------------------------


def attention_check(info: DeviceInfo) -> tuple[bool, str]:
    dtype = torch.bfloat16 if info.bf16 else torch.float16
    results = probe_attention((1, 2, 67, 128), dtype, info, False, use_cache=False, warmup=1, reps=2)
    name = chosen(results)
    if name is None:
        return False, "no attention backend passed: " + "; ".join(f"{r.name}: {r.error}" for r in results)
    return True, f"backends work here (at 67 tokens: {name}); chosen at the run's shape at its first forward"


def compile_check(info: DeviceInfo) -> tuple[bool, str]:
    dev = info.torch_device

    def f(x, w):
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (x.shape[-1],)) * w, approximate="tanh")

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=gen) + 0.5).to(dev).requires_grad_()
    w = (torch.randn(64, generator=gen) + 1.0).to(dev)
    compiled = torch.compile(f)
    (want, dwant), (got, dgot) = _run(f, (x, w), seed=1), _run(compiled, (x, w), seed=1)
    err = max(reference.max_rel_err(g, w_) for g, w_ in zip(got + dgot, want + dwant, strict=True))
    if not err <= 1e-4:
        return False, f"torch.compile result differs from eager (max rel. error {err:.2e})"
    return True, "torch.compile (inductor) works here"


# ---- the registry -----------------------------------------------------------------------------------------------

REGISTRY: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        KernelSpec(
            "chroma_blocks",
            "Chroma's double and single blocks with our forward: the captions' padding left out of attention by a "
            "mask over the whole batch instead of sd-scripts' per-sample trim (a host sync and data-dependent "
            "shapes in every block), the same values at every position; what lets the attention backend, the fused "
            "ops, single_qkv, fp8_matmul and compile_blocks into Chroma's blocks",
            any_applies,
            chroma.install,
            reference=chroma.reference_trimmed_attention,
            fast=chroma.masked_attention,
            example=chroma_example,
            auto_if=chroma.has_chroma_blocks,
            auto_if_static=True,
        ),
        KernelSpec(
            "attention",
            "choose the attention backend by measurement at the run's shape (SDPA cuDNN / flash / efficient / math, "
            "xformers, flash-attn, cuDNN's forward with FlashAttention-4's backward when importable); "
            f"{SAGE_REASON}",
            cuda_applies,
            functools.partial(patch.install_block_op, op="attention"),
            check=attention_check,
        ),
        KernelSpec(
            "qk_norm_rope",
            "QKNorm (RMSNorm of q and k, fp32) + RoPE in one Triton pass, written straight into the concatenated "
            "txt+img q/k",
            triton_applies,
            functools.partial(patch.install_block_op, op="qk_norm_rope"),
            reference=reference.qk_norm_rope_cat,
            fast=functools.partial(fast.qk_norm_rope_cat, fallback=False),
            example=qk_example,
            in_auto=False,  # opt-in until bench_kernels --blocks shows compiled+kernels beating compile_blocks
        ),
        KernelSpec(
            "modulate",
            "LayerNorm (no affine) + (1 + scale) * x + shift in one Triton pass",
            triton_applies,
            functools.partial(patch.install_block_op, op="modulate"),
            reference=reference.modulate,
            fast=functools.partial(fast.modulate, fallback=False),
            example=modulate_example,
            in_auto=False,  # opt-in until bench_kernels --blocks shows compiled+kernels beating compile_blocks
        ),
        KernelSpec(
            "gated_residual",
            "x + gate * y in one Triton pass (gate gradient reduced over L in the same pass)",
            triton_applies,
            functools.partial(patch.install_block_op, op="gated_residual"),
            reference=reference.gated_residual,
            fast=functools.partial(fast.gated_residual, fallback=False),
            example=gated_example,
            in_auto=False,  # opt-in until bench_kernels --blocks shows compiled+kernels beating compile_blocks
        ),
        KernelSpec(
            "gated_modulate",
            "double blocks: the residual update x + gate * y and the LayerNorm + modulation of its result that "
            "feeds the MLP, in one Triton pass forward and one backward (the residual is recomputed, not kept)",
            triton_applies,
            functools.partial(patch.install_block_op, op="gated_modulate"),
            reference=reference.gated_modulate,
            fast=functools.partial(fast.gated_modulate, fallback=False),
            example=gated_modulate_example,
            in_auto=False,  # opt-in until bench_kernels --blocks shows compiled+kernels beating compile_blocks
        ),
        KernelSpec(
            "single_qkv",
            "single blocks: linear1's output to q, k, v (QKNorm, RoPE) and the MLP's GELU as one autograd function "
            "whose backward is written out, so inside compiled blocks every part of linear1's gradient is written "
            "straight into its slice (plain PyTorch; the forward is sd-scripts' op for op)",
            compile_applies,
            functools.partial(patch.install_block_op, op="single_qkv"),
            reference=single_qkv.reference_single_qkv,
            # GELU's gradient in the kernel too (what lora_fold's mirror-folded linear2 gets): the most of our code
            fast=functools.partial(single_qkv.single_qkv, gelu_in_kernel=True),
            example=single_qkv_example,
        ),
        KernelSpec(
            "double_qkv",
            "double blocks: both streams' qkv outputs to q, k, v (QKNorm per stream, RoPE over both) as one autograd "
            "function whose backward is written out, each stream's q/k/v gradient in one Triton kernel (the "
            "forward is sd-scripts' op for op)",
            compile_applies,
            functools.partial(patch.install_block_op, op="double_qkv"),
            reference=single_qkv.reference_double_qkv,
            fast=single_qkv.double_qkv,
            example=double_qkv_example,
            in_auto=False,  # opt-in: no whole-step gain measured (H200, vram80, A B B A with fp8 and with auto)
        ),
        KernelSpec(
            "fp8_matmul",
            "the blocks' frozen Linear layers multiply in fp8 (torch._scaled_mm, e4m3, per-row scales) forward and "
            "for the input gradient, instead of upcasting the weights every matmul; auto: on an fp8 base only",
            fp8_applies,
            patch.install_fp8,
            reference=fp8.reference_linear,
            fast=fp8.fp8_linear,
            example=fp8_example,
            dtypes=(torch.bfloat16,),
            tolerance=FP8_TOLERANCE,
            auto_if=fp8_base_only,
        ),
        KernelSpec(
            "lora_fold",
            f"a LoRA factor inside the frozen GEMM, on LoRA'd Linear layers with out >= {lora_fold.WIDE}x in (B beside "
            "W: [x, s·x·Aᵀ] @ [W, B]ᵀ, and dY @ B inside the input gradient's GEMM; FLUX: single blocks' linear1, the "
            "MLPs' first layer) or "
            f"in >= {lora_fold.WIDE_IN}x out (A below W: x @ [W; A]ᵀ, and [dY, s·dY @ B] @ [W; A] for the input "
            "gradient; FLUX: linear2 and the MLPs' second layer)",
            cuda_applies,
            patch.install_lora_fold,
            reference=lora_fold.reference_mlp,
            fast=lora_fold.fast_mlp,
            example=lora_fold_example,
            dtypes=(torch.bfloat16,),  # as FLUX trains; float32 GEMMs run as TF32 where the launcher allows it
            auto_if=has_wide_lora,
        ),
        KernelSpec(
            "flux_prologue",
            "the model's per-step embeddings without the host work the GPU waits on: timestep frequencies kept on the "
            "device (sd-scripts copies them from pageable host memory, a sync, twice a step) and the RoPE table in one "
            "pass (~40 small kernels a step); the same bits",
            any_applies,
            prologue.install,
            reference=prologue.reference_prologue,
            fast=prologue.fast_prologue,
            example=prologue_example,
            dtypes=(torch.float32,),
        ),
        KernelSpec(
            "lora_grad_norms",
            "the LoRA gradient row norms sd-scripts computes every step (norm/avg_grad_norm, GGPO) from a [2r, 2r] "
            "Gram matrix per module instead of a weight-sized product (55 ms of a 0.43 s FLUX step on an H200)",
            any_applies,
            patch.install_lora_norms,
            reference=lora_norms.reference_row_norms,
            fast=lora_norms.row_norms,
            example=lora_norms_example,
            dtypes=(torch.float32,),
            tolerance=1e-5,
            auto_if=has_lora,
        ),
        KernelSpec(
            "prodigy_step",
            "Prodigy's optimizer step (prodigyopt, the default optimizer) in multi-tensor ops with one device sync "
            "per step instead of two per parameter tensor (~1.2k on a FLUX LoRA)",
            any_applies,
            prodigy.install,
            check=lambda info: prodigy.self_check(info.torch_device),
            target="optimizer",  # in auto: 0.519 -> 0.408 s/step on a vram80 Prodigy run (H200, README)
        ),
        KernelSpec(
            "adamw_step",
            "torch's AdamW step fused (one kernel per device and dtype, step counts on the device) instead of the "
            "multi-tensor path sd-scripts gets, which reads two step counts a parameter tensor back as Python numbers",
            any_applies,
            adamw.install,
            check=lambda info: adamw.self_check(info.torch_device),
            target="optimizer",
        ),
        KernelSpec(
            "single_process_reduce",
            "no gradient all-reduce on one process, where sd-scripts' reduce is a copy and a division by 1 of every "
            "LoRA gradient (~1.2k kernels a step on FLUX), bit for bit the same gradients",
            any_applies,
            single_process.install,
            check=lambda info: single_process.self_check(info.torch_device),
            target="trainer",
        ),
        KernelSpec(
            "coalesced_reduce",
            "with several processes, the LoRA gradients averaged by one all-reduce per dtype over a flat buffer "
            "instead of sd-scripts' one per tensor (~600 collectives a step on FLUX), the same sums",
            several_processes,
            coalesced_reduce.install,
            check=lambda info: coalesced_reduce.self_check(info.torch_device),
            target="trainer",  # 2 H200s, vram80 auto: 608 all-reduces, 294 ms of NCCL kernels a step (README)
        ),
        KernelSpec(
            "selective_checkpoint",
            "checkpointed blocks keep their attention output and the outputs of matmuls whose input is >= "
            f"{sac.RATIO}x wider than their output (linear2, MLP down, LoRA down) instead of recomputing them in "
            "backward: ~54 MiB per block at 1024², about a tenth of an un-checkpointed block",
            cuda_applies,
            sac.install,
            reference=sac.reference_region,
            fast=sac.selective_region,
            example=sac_example,
            auto_if=checkpoints_blocks,  # H200, 1024², every block checkpointed: 0.535 -> 0.468 s/step (vram48)
            auto_if_static=True,  # gradient checkpointing, its offload and block swap are sd-scripts' settings
        ),
        KernelSpec(
            "compile_blocks",
            "regional torch.compile: block.compile() on every double/single block (first step compiles)",
            compile_applies,
            compile_blocks.install,
            check=compile_check,
        ),
        KernelSpec(
            "activation_offload",
            "checkpointed blocks' saved tensors (their inputs, selective_checkpoint's outputs) wait in page-locked "
            "host memory from forward to backward, copied on a side stream and reloaded one block ahead; needs "
            "compile_blocks (installed after it: it wraps the compiled calls)",
            cuda_applies,
            activation_offload.install,
            reference=activation_offload.reference_region,
            fast=activation_offload.offloaded_region,
            example=offload_example,
            in_auto=False,  # slower at a tier's own cap without CUDA graphs (README); kernels=offload adds them
        ),
        KernelSpec(
            "block_swap",
            "sd-scripts' block swap schedule (--blocks_to_swap) with each swapped weight's page-locked host copy made "
            "once, the outgoing block pointed back at it (no copy: the weights are frozen) and the incoming one "
            "copied into the card buffers it frees on a side stream ordered by CUDA events, instead of host waits "
            "on the whole compute stream and pageable copies both ways for every swap",
            cuda_applies,
            block_swap.install,
            check=lambda info: block_swap.self_check(info.torch_device),
            auto_if=swaps_blocks,  # last: it copies the weights as the kernels before it (fp8_matmul) left them
        ),
    )
}
if tuple(REGISTRY) != KERNEL_NAMES:  # the launcher checks configurations against KERNEL_NAMES without this module
    raise RuntimeError(
        f"flux_kernels.runtime.request.KERNEL_NAMES must list the registry's kernels in order: {tuple(REGISTRY)}"
    )


def _request(requested: str | Iterable[str] | None, registry: Mapping[str, KernelSpec]) -> KernelRequest:
    try:
        return parse_request(requested, registry)
    except ValueError as e:
        raise KernelError(str(e)) from None


def unchecked(names: Iterable[str], registry: Mapping[str, KernelSpec] | None = None) -> Selection:
    """A Selection of exactly `names` with no applies/probe step: for benchmarks and tests that compare
    configurations on purpose. Training goes through `select`."""
    registry = REGISTRY if registry is None else registry
    names = _request(list(names), registry).named
    return Selection(names, {}, None, tuple(registry[n] for n in names), explicit=True)


def select(
    requested: str | Iterable[str] | None = "auto",
    device=None,
    registry: Mapping[str, KernelSpec] | None = None,
    target: str = "model",
    model: Any = None,
) -> Selection:
    """Decide what to install on `device` (default: the current CUDA device, else CPU), among the kernels whose
    install takes `target` (the model; the optimizer's are selected when sd-scripts has built it). With `model`, a
    kernel auto would skip on it (a static `auto_if`: Chroma's blocks on a FLUX.1 model, selective checkpointing with
    block swap) is skipped before its probe (3.4-3.8 and 1.4 s of a FLUX.1 start on an H200)."""
    registry = REGISTRY if registry is None else registry
    info = as_device_info(device)
    request = _request(requested, registry)
    candidates = [n for n, s in registry.items() if request.wants(n, s.in_auto) and s.target == target]
    installed, skipped, seconds = [], {}, {}
    for name in candidates:
        spec = registry[name]
        start = time.perf_counter()
        ok, why = spec.applies(info)
        if ok and model is not None and spec.auto_if_static and spec.auto_if is not None:
            if request.auto and name not in request.named:  # a named kernel is probed: apply_kernels says why not
                ok, why = spec.auto_if(model)
                if not ok:
                    seconds[name] = time.perf_counter() - start
                    skipped[name] = why
                    log.info("kernel %s skipped: %s", name, why)
                    continue
        if ok:
            result = probe(spec, info)
            ok, why = result.ok, result.reason
        seconds[name] = time.perf_counter() - start
        if ok:
            installed.append(name)
        elif name in request.named:
            raise KernelError(f"kernel {name!r} cannot run on {info.name}: {why}; remove it from kernels= or use auto")
        else:
            skipped[name] = why
            log.info("kernel %s skipped: %s", name, why)
    specs = tuple(registry[n] for n in installed)
    return Selection(
        tuple(installed), skipped, info, specs, explicit=not request.auto, named=request.named, seconds=seconds
    )
