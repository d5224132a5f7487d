"""Doctor checks of attention backends and flux_kernels' own kernels: each one that can run here runs forward and
backward and is compared with a reference. One that is installed but raises, or gives wrong numbers, is a FAIL:
silently skipping it is how a user ends up with NaN losses or a run at half speed without knowing why.

Attention goes through `flux_kernels.patches.attention.probe.probe_attention` (fp32 math reference, the same verdict
training's attention choice reaches) at a FLUX shape: 24 heads x (4096 image + 512 text) tokens x 128, bf16. Our other
kernels go through `flux_kernels.runtime.registry.probe`, the probe `kernels=auto` runs before installing them.
flux_kernels is imported lazily, and an API that differs from what is expected is reported as a warning row,
never raised: the doctor must not crash on the thing it is diagnosing.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from flux_trainer.doctor.core import FAIL, PASS, SKIP, WARN, CheckResult, one_line

GROUP_ATTENTION, GROUP_KERNELS = "attention", "kernels"
FLUX_SHAPE = (1, 24, 4096 + 512, 128)  # 1024x1024: 4096 image tokens + 512 T5 tokens, FLUX.1's 24 heads of 128
SMALL_SHAPE = (1, 24, 1024 + 512, 128)  # 512x512, for cards where the fp32 reference at 1024^2 would not fit
REFERENCE = "sdpa_math"  # the reference itself is not a candidate
SDPA_VARIANTS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")


def _fix_for(name: str) -> str:
    if name == "xformers":
        return "pip install -U xformers built for your torch (or pip uninstall xformers); keep kernels.attention=sdpa"
    if name == "flash_attn":
        return (
            "reinstall flash-attn built for your torch and GPU (pip install flash-attn --no-build-isolation), or "
            "pip uninstall flash-attn"
        )
    if name == "cudnn_fa4":
        return "reinstall flash-attn-4 for your torch and GPU (pip install -U flash-attn-4), or uninstall it"
    if name.startswith("sdpa"):
        return "reinstall PyTorch for this card's CUDA (see the torch build row); report it if it persists"
    return f"reinstall {name} for your torch and GPU, or uninstall it"


def _optional(why: str) -> str:
    """flux_kernels' reason a backend cannot be tried here ('' if it can), a missing package marked optional (with
    what to pip install, where flux_kernels names it)."""
    missing, hint, install = why.partition(" (pip install ")
    if not missing.endswith("is not installed"):
        return why
    return f"{missing} (optional; pip install {install}" if hint else f"{missing} (optional)"


def attention_checks(
    device: Any = "cuda",
    *,
    shape: tuple[int, int, int, int] = FLUX_SHAPE,
    dtype: Any = None,
    backends: Mapping[str, Any] | None = None,
) -> list[CheckResult]:
    """One row per backend: pass (matches, with its time), warn (PyTorch has no such SDPA kernel for this card or
    shape: sdpa uses another), skip (not installed / not applicable), fail (raises or is wrong)."""
    try:
        import torch

        fk_probe = importlib.import_module("flux_kernels.patches.attention.probe")
        fk_backends = importlib.import_module("flux_kernels.patches.attention.backends")

        probe_attention, unavailable = fk_probe.probe_attention, fk_probe.unavailable
        candidates = dict(fk_backends.BACKENDS if backends is None else backends)
    except Exception as e:  # noqa: BLE001 - a half-finished or changed flux_kernels must not crash the doctor
        return [
            CheckResult(
                "attention",
                WARN,
                f"flux_kernels.patches.attention unusable ({one_line(e)}): backends not checked",
                "reinstall flux-train (pip install -e .)",
                GROUP_ATTENTION,
            )
        ]
    candidates.pop(REFERENCE, None)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dtype is None else dtype
    rows, runnable = [], {}
    for name, backend in candidates.items():
        why = _optional(unavailable(backend, dev))
        if why:
            rows.append(CheckResult(f"attention: {name}", SKIP, why, "", GROUP_ATTENTION))
        else:
            runnable[name] = backend
    if not runnable:
        return rows
    where = f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
    try:
        results = probe_attention(shape, dtype, dev, False, backends=runnable, use_cache=False, warmup=1, reps=3)
    except Exception as e:  # noqa: BLE001 - the fp32 reference itself failed (OOM on a busy card) or the API changed
        rows.append(
            CheckResult(
                "attention",
                WARN,
                f"the attention probe could not run at {where}: {one_line(e)}",
                "free GPU memory (other processes?) and rerun `flux-train doctor`",
                GROUP_ATTENTION,
            )
        )
        return rows
    rows += [_attention_row(r, where) for r in results]
    order = {f"attention: {name}": i for i, name in enumerate(candidates)}
    return sorted(rows, key=lambda r: order.get(r.check, len(order)))  # the backends' own order, not by speed


def _attention_row(r: Any, where: str) -> CheckResult:
    name = r.name
    data = {"max_rel_err": r.max_err, "ms_fwd_bwd": r.ms_fwd_bwd, "chosen": bool(getattr(r, "chosen", False))}
    if r.ok:
        err = f"max rel. error {r.max_err:.1e}" if r.max_err is not None else "matches"
        ms = f", {r.ms_fwd_bwd:.2f} ms fwd+bwd" if r.ms_fwd_bwd is not None else ""
        fastest = " (fastest here)" if data["chosen"] else ""
        return CheckResult(
            f"attention: {name}", PASS, f"{where}: {err} vs fp32{ms}{fastest}", "", GROUP_ATTENTION, data
        )
    error = r.error or "failed"
    if name in SDPA_VARIANTS and "No available kernel" in error:
        return CheckResult(
            f"attention: {name}",
            WARN,
            f"PyTorch has no {name.removeprefix('sdpa_')} kernel for this GPU at {where} ({error})",
            "none needed for training: sdpa picks a backend that works; a newer PyTorch may add it",
            GROUP_ATTENTION,
            data,
        )
    what = "gives wrong results" if error.startswith("wrong") else "imports but errors"
    return CheckResult(f"attention: {name}", FAIL, f"{what} at {where}: {error}", _fix_for(name), GROUP_ATTENTION, data)


LAYOUT_TOLERANCE = 0.05  # bf16 gradients against fp32: ~1e-2 on a correct stack, 1.3-2.2 with the fault


def gradient_layout_check(
    device: Any = "cuda", *, name: str = "sdpa_cudnn", dtype: Any = None, backends: Mapping[str, Any] | None = None
) -> CheckResult:
    """Whether a backend's backward stays right when, at one shape, the incoming gradient comes in another layout
    than in its first backward (torch 2.11 + cuDNN 9.19 keep the first: wrong q/k/v gradients, silently).
    flux-train's blocks always hand an SDPA backend's backward one layout
    (flux_kernels.patches.attention.backends.heads_to_tokens; `cudnn_fa4` uses FlashAttention-4's backward, which
    takes any), so a warning here is about other code on this stack, not flux-train's training."""
    check = f"attention: {name} gradient layout"
    try:
        import torch

        fk_probe = importlib.import_module("flux_kernels.patches.attention.probe")
        dtype = torch.bfloat16 if dtype is None else dtype
        err = fk_probe.gradient_layout_error(name, device, dtype=dtype, backends=backends)
    except Exception as e:  # noqa: BLE001 - the check must not crash the doctor
        if "No available kernel" in str(e):
            return CheckResult(check, SKIP, f"PyTorch has no {name} kernel here ({one_line(e)})", "", GROUP_ATTENTION)
        return CheckResult(check, WARN, f"could not run: {one_line(e)}", "", GROUP_ATTENTION)
    data = {"max_rel_err": err}
    if err <= LAYOUT_TOLERANCE:  # NaN compares false: a warning
        evidence = (
            f"a second backward at one shape with the gradient in another layout: right q/k/v gradients (max rel. "
            f"error {err:.1e} vs fp32)"
        )
        return CheckResult(check, PASS, evidence, "", GROUP_ATTENTION, data)
    evidence = (
        f"a second backward at one shape with the gradient in another layout gets wrong q/k/v gradients (max rel. "
        f"error {err:.2g} vs fp32): this PyTorch keeps the first layout it saw per shape. flux-train's blocks always "
        "hand the attention one layout, so its training is not affected; other code using SDPA here can be"
    )
    fix = (
        "nothing for flux-train; for other code on this stack: torch.backends.cuda.enable_cudnn_sdp(False), or a "
        "PyTorch / cuDNN that fixes it"
    )
    return CheckResult(check, WARN, evidence, fix, GROUP_ATTENTION, data)


def kernel_checks(device: Any = "cuda", *, registry: Mapping[str, Any] | None = None) -> list[CheckResult]:
    """One row per flux_kernels kernel (attention choice aside, covered above): skip where it does not apply, else
    its probe (fast vs reference, forward and backward) decides pass or fail."""
    try:
        fk_registry = importlib.import_module("flux_kernels.runtime.registry")
        probe = fk_registry.probe
        specs = dict(fk_registry.REGISTRY if registry is None else registry)
    except Exception as e:  # noqa: BLE001
        return [
            CheckResult(
                "kernels",
                WARN,
                f"flux_kernels.runtime.registry unusable ({one_line(e)}): kernels not checked",
                "reinstall flux-train (pip install -e .)",
                GROUP_KERNELS,
            )
        ]
    rows = []
    for name, spec in specs.items():
        if name == "attention":
            continue
        check = f"kernel: {name}"
        try:
            applies, why = spec.applies(device)
        except Exception as e:  # noqa: BLE001
            rows.append(CheckResult(check, FAIL, f"applies() raised {one_line(e)}", _kernel_fix(name), GROUP_KERNELS))
            continue
        if not applies:
            rows.append(CheckResult(check, SKIP, why, "", GROUP_KERNELS))
            continue
        try:
            result = probe(spec, device)
        except Exception as e:  # noqa: BLE001 - probe() catches its own errors; this is belt and braces
            rows.append(CheckResult(check, FAIL, f"probe raised {one_line(e)}", _kernel_fix(name), GROUP_KERNELS))
            continue
        data = {"max_rel_err": getattr(result, "max_err", None)}
        if result.ok:
            err = data["max_rel_err"]
            extra = f", max rel. error {err:.1e}" if isinstance(err, float) and err > 0 else ""
            rows.append(CheckResult(check, PASS, f"{result.reason}{extra}", "", GROUP_KERNELS, data))
        else:
            rows.append(CheckResult(check, FAIL, result.reason, _kernel_fix(name), GROUP_KERNELS, data))
    return rows


def _kernel_fix(name: str) -> str:
    return (
        f"kernels=auto leaves {name} out after its probe fails; to be sure use kernels=off, and update "
        "triton/flux-train"
    )


def attention_and_kernel_checks(info: Any) -> list[CheckResult]:
    """On the GPU that trains: attention at 1024^2 (512^2 on cards under 20 GiB) and every kernel's probe."""
    if not info.is_gpu:
        return [
            CheckResult(
                "attention", SKIP, "no CUDA GPU: backends are checked on the GPU that trains", "", GROUP_ATTENTION
            ),
            CheckResult("kernels", SKIP, "no CUDA GPU: flux_kernels apply to CUDA GPUs", "", GROUP_KERNELS),
        ]
    import torch

    if not torch.cuda.is_available():
        return [CheckResult("attention", SKIP, "CUDA is not available in this process", "", GROUP_ATTENTION)]
    device = torch.device("cuda", info.index)
    shape = FLUX_SHAPE if info.vram_gib >= 20 else SMALL_SHAPE
    dtype = torch.bfloat16 if info.bf16 else torch.float16
    rows = attention_checks(device, shape=shape, dtype=dtype)
    torch.cuda.empty_cache()
    rows += kernel_checks(device)
    torch.cuda.empty_cache()
    rows.append(gradient_layout_check(device, dtype=dtype))  # after the others: the fault once broke a CUDA context
    return rows
