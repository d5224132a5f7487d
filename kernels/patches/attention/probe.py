"""Attention backend choice: every backend that can run here, measured forward+backward at the real shape,
checked against a float32 math reference, the fastest correct one chosen, the verdict cached on disk.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from flux_kernels.patches.attention.backends import BACKENDS, AttentionBackend, heads_to_tokens
from flux_kernels.runtime.device import as_device_info
from flux_kernels.runtime.timing import queued_ms

log = logging.getLogger(__name__)

# A backend is correct if its error against the fp32 truth is within this, or within 3x the error of PyTorch's
# own math backend run in the same dtype (long sequences in bf16 are legitimately that far off).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-3}
CACHE_ENV = "FLUX_KERNELS_CACHE"
EXCLUDE_ENV = "FLUX_KERNELS_ATTENTION_EXCLUDE"  # backends the probe leaves out (comma list), to measure without them
REF_HEADS = 2  # heads checked against the fp32 math reference (all heads are run and timed)
# A backend that materialises [B, H, L, L] weights is not tried where they would take more than this: the probe runs
# at the run's first forward, and at 4608 tokens the math backend's forward+backward would borrow ~4 GiB more than
# the training step itself needs (on a 16 GB card, an out-of-memory before the first step). It is never the fastest
# at such lengths.
QUADRATIC_PROBE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class BackendResult:
    name: str
    ok: bool
    error: str = ""
    max_err: float | None = None
    ms_fwd_bwd: float | None = None
    chosen: bool = False


def library_versions() -> dict[str, str]:
    """Versions that change which attention kernels exist or how fast they are: part of the cache key."""
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "cudnn": "none"}
    if torch.backends.cudnn.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
    for dist in ("xformers", "flash_attn", "flash-attn-4", "sageattention"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "none"
    return out


def cache_key(
    shape: Sequence[int],
    dtype: torch.dtype,
    device,
    with_mask: bool,
    versions: Mapping[str, str] | None = None,
    backends: Sequence[str] = (),
) -> str:
    """Device name + capability + library versions + the backends tried + shape/dtype/mask: a new torch, cuDNN,
    xformers or GPU never reuses an old verdict."""
    info = as_device_info(device)
    versions = library_versions() if versions is None else versions
    cap = f"sm{info.capability[0]}{info.capability[1]}" if info.capability else info.type
    libs = ",".join(f"{k}={versions[k]}" for k in sorted(versions))
    dt = str(dtype).removeprefix("torch.")
    tried = ",".join(sorted(backends))
    return f"{info.name}|{cap}|{libs}|{tried}|{'x'.join(map(str, shape))}|{dt}|mask={with_mask}"


def default_cache_path() -> Path:
    """$FLUX_KERNELS_CACHE, else <flux-train's cache folder>/kernels/attention_probe.json (same root as
    flux_trainer.config.paths.cache_root, read here from the environment so this package stands alone)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    root = os.environ.get("FLUX_TRAIN_CACHE")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flux-trainer")
    return Path(root).expanduser() / "kernels" / "attention_probe.json"


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, results: Sequence[BackendResult]) -> None:
    """Read-modify-replace: several ranks may probe at once; the file is always whole."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = [asdict(r) for r in results]
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("attention probe: could not write cache %s (%s)", path, e)


def unavailable(backend: AttentionBackend, dev: torch.device) -> str:
    """Why `backend` cannot be tried on `dev` at all (no backward, not installed, CUDA only, too old a GPU); '' if it
    can. The probe skips such backends with this reason (the run's log has it); flux-train's doctor shows it. The
    device comes first (no package would help there), then a missing package, with what to pip install for it."""
    if not backend.trainable:
        return backend.note
    if why := _hardware(backend, dev):
        return why
    if backend.requires and not importable(backend.requires):
        hint = f" (pip install {backend.install})" if backend.install else ""
        return f"{backend.requires} is not installed{hint}"
    return ""


def _hardware(backend: AttentionBackend, dev: torch.device) -> str:
    """Why the device cannot run `backend` whatever is installed ('' if it can)."""
    if backend.cuda_only and dev.type != "cuda":
        return f"needs CUDA (device is {dev.type})"
    if backend.min_capability and dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if cap < backend.min_capability:
            need = "sm{}{}".format(*backend.min_capability)
            return f"needs {need} or newer (the GPU is sm{cap[0]}{cap[1]})"
    return ""


def importable(module: str) -> bool:
    """Whether `module` can be found without importing it (a dotted name's parent is imported, and may be absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _inputs(shape, dtype, dev, with_mask: bool, seed: int = 0):
    B, H, L, D = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, go = (torch.randn(B, H, L, D, generator=g).to(dev, dtype) for _ in range(4))
    mask = None
    if with_mask:  # a text-padding mask like sd-scripts': some keys masked, the first always kept
        keep = torch.rand(B, L, generator=g) > 0.25
        keep[:, 0] = True
        mask = keep.to(dev)[:, None, None, :].expand(B, H, L, L)
    return q, k, v, go, mask


def _fwd_bwd(run, q, k, v, go, mask):
    """Forward and input gradients in the inputs' own dtype, whatever grad mode or autocast the caller is in."""
    with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = run(q, k, v, mask)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return out, dq, dk, dv


class _WideGradient(torch.autograd.Function):
    """Identity on tokens [B, L, C] whose backward hands on the gradient as a column slice of a [B, L, 2C] buffer: the
    layout a single block's attention gradient has (a slice of linear2's input gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        wide = grad.new_zeros(*grad.shape[:-1], 2 * grad.shape[-1])
        wide[..., : grad.shape[-1]] = grad
        return wide[..., : grad.shape[-1]]


def as_trained(backend: AttentionBackend) -> Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]:
    """What the probe runs of a backend: what the blocks run, the attention as tokens [B, L, H*D] (the backend's own
    tokens form, else `heads_to_tokens` over its output), seen as [B, H, L, D] again for the comparison, its gradient
    arriving as a column slice of a wider buffer, the layout a single block's gradient has. Every backend is checked
    in the layouts training hands it and timed with the conversions training adds to it."""

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        if backend.tokens is not None:
            x = backend.tokens(q, k, v, mask)
        else:
            x = heads_to_tokens(backend.run(q, k, v, mask))
        return _WideGradient.apply(x).unflatten(2, (q.shape[1], -1)).transpose(1, 2)

    return run


def _rel_err(got: Sequence[Tensor], want: Sequence[Tensor]) -> float:
    errs = [
        ((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() for g, w in zip(got, want, strict=True)
    ]
    return float("nan") if any(e != e for e in errs) else max(errs)


def probe_attention(
    shape: Sequence[int],
    dtype: torch.dtype,
    device,
    with_mask: bool,
    *,
    backends: Mapping[str, AttentionBackend] | None = None,
    cache_path: Path | str | None = None,
    use_cache: bool = True,
    warmup: int = 2,
    reps: int = 5,
    timer: Callable[[str, Callable[[], object]], float] | None = None,
) -> list[BackendResult]:
    """Run every backend forward+backward at `shape` (B, H, L, D), compare output and gradients with SDPA's
    math backend in fp32, time the correct ones; return all results, fastest correct first (`chosen`).
    Each backend is timed with `reps` calls queued back to back (`queued_ms`), as a training step runs them: a
    backend's host code overlaps the device's work. `timer(name, fn) -> ms` replaces that timing (tests use it to
    be independent of load). A verdict read from the cache is returned once its choice passes the same check again
    here (`_recheck`, not timed); where it fails, every backend is probed afresh."""
    dev = as_device_info(device).torch_device
    backends = BACKENDS if backends is None else backends
    excluded = {n.strip() for n in os.environ.get(EXCLUDE_ENV, "").split(",") if n.strip()}
    backends = {n: b for n, b in backends.items() if n not in excluded}
    path = Path(cache_path) if cache_path else default_cache_path()
    key = cache_key(tuple(shape), dtype, device, with_mask, backends=list(backends))
    rng = [dev] if dev.type == "cuda" else []
    if use_cache:
        hit = _read_cache(path).get(key)
        if hit and all(r.get("name") in backends for r in hit):
            cached = [BackendResult(**r) for r in hit]
            with torch.random.fork_rng(devices=rng):
                why = _recheck(cached, shape, dtype, dev, with_mask, backends)
            if not why:
                return cached
            log.warning("attention probe: the cached choice %s failed its check at %s (%s); probing again",
                        chosen(cached), tuple(shape), why)  # fmt: skip
    # The random streams are put back as they were. The probe runs after the run is seeded, at its first forward, and
    # only where the verdict is not cached: whatever it draws from a generator (a fused attention op's dropout state,
    # say) would give a run that probes other noise and timesteps than the same run with the verdict cached. (On an
    # H100 at vram80, same seed, a run that probed logged step 1's loss 1.80 and the next one 3.03; with this, a run
    # that probed and two that read its verdict logged 1.79547, 1.79547 and 1.79554.)
    with torch.random.fork_rng(devices=rng):
        results = _measure(shape, dtype, dev, with_mask, backends, warmup, reps, timer)
    if use_cache:
        _write_cache(path, key, results)
    return results


class _Truth:
    """The probe's inputs at a shape and the fp32 truth to check a backend against, with the tolerance.

    Heads are independent, so the fp32 truth is computed for the first REF_HEADS heads only: the math backend at
    24 x 4608^2 in fp32 would need several GB, too much to borrow on a 24 GB card mid-setup."""

    def __init__(self, shape, dtype, dev: torch.device, with_mask: bool):
        self.inputs = _inputs(shape, dtype, dev, with_mask)
        q, k, v, go, mask = self.inputs
        self.head = (slice(None), slice(0, min(REF_HEADS, shape[1])))
        mask_h = None if mask is None else mask[self.head]
        math = BACKENDS["sdpa_math"].run
        self.want = _fwd_bwd(math, *(t[self.head].float() for t in (q, k, v, go)), mask_h)
        base = _rel_err(_fwd_bwd(math, *(t[self.head] for t in (q, k, v, go)), mask_h), self.want)
        self.tol = max(TOLERANCE.get(dtype, 2e-2), 3 * base)

    def error(self, run: Callable) -> float:
        """`run`'s (as_trained's) largest relative error, output and gradients, against the truth."""
        return _rel_err([t[self.head] for t in _fwd_bwd(run, *self.inputs)], self.want)

    def wrong(self, err: float) -> str:
        return "" if err <= self.tol else f"wrong: max rel. error {err:.2e} > {self.tol:.2e}"


def _recheck(cached: Sequence[BackendResult], shape, dtype, dev: torch.device, with_mask: bool, backends) -> str:
    """Why a cached verdict's choice fails here ('' where it passes): checked against the fp32 truth at the run's
    shape, not timed. A verdict read from disk says the choice was right in the process that probed; kernels come
    from disk caches too (FlashAttention-4 keeps its compiled kernels, by a fingerprint of its own sources), and
    this runs them against the truth in the process that trains with them."""
    name = chosen(cached)
    if name is None:
        return ""
    backend = backends[name]
    if why := unavailable(backend, dev):
        return why
    try:
        truth = _Truth(shape, dtype, dev, with_mask)
        return truth.wrong(truth.error(as_trained(backend)))
    except Exception as e:  # noqa: BLE001 - a failure of the cached choice is a reason to probe again
        return _failure(e)


def _failure(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _measure(shape, dtype, dev: torch.device, with_mask: bool, backends, warmup: int, reps: int, timer):
    """probe_attention's measurement: every backend's error against the fp32 truth and the correct ones' time."""
    truth = _Truth(shape, dtype, dev, with_mask)
    results = []
    for name, backend in backends.items():
        why = unavailable(backend, dev)
        weights = shape[0] * shape[1] * shape[2] ** 2 * torch.finfo(dtype).bits // 8
        if not why and backend.quadratic and weights > QUADRATIC_PROBE_BYTES:
            why = f"not tried at {shape[2]} tokens: it materialises [B, H, L, L] weights ({weights / 2**30:.2f} GiB)"
        if why:
            results.append(BackendResult(name, False, why))
            continue
        try:
            trained = as_trained(backend)
            err = truth.error(trained)
            if wrong := truth.wrong(err):
                results.append(BackendResult(name, False, wrong, err))
                continue
            run = functools.partial(_fwd_bwd, trained, *truth.inputs)
            ms = timer(name, run) if timer else queued_ms(run, dev, warmup, reps)
            results.append(BackendResult(name, True, "", err, ms))
        except Exception as e:  # noqa: BLE001 - any failure disqualifies the backend; the reason is reported
            results.append(BackendResult(name, False, _failure(e)))
    results.sort(key=lambda r: (not r.ok, r.ms_fwd_bwd if r.ok else 0.0))
    if results and results[0].ok:
        results[0] = BackendResult(**{**asdict(results[0]), "chosen": True})
    return results


LAYOUT_SHAPE = (1, 3, 300, 64)  # small, and a shape nothing else runs at (the fault depends on what ran before)


def gradient_layout_error(
    name: str = "sdpa_cudnn",
    device="cuda",
    shape: Sequence[int] = LAYOUT_SHAPE,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backends: Mapping[str, AttentionBackend] | None = None,
) -> float:
    """The largest relative error of a backend's q/k/v gradients, against fp32 math, in a backward whose incoming
    gradient has the layout a "B H L D -> B L (H D)" rearrange sends back ([B, L, H, D] memory), after a first
    backward at the same shape with a contiguous one: the fault `heads_to_tokens` works around. About bf16's
    rounding (~1e-2) on a correct stack; 1.3-2.2 measured on torch 2.11 + cuDNN 9.19 (H200) for sdpa_cudnn. Run it
    once per process at a shape of its own: which layout a shape's first backward had decides the outcome."""
    run = (BACKENDS if backends is None else backends)[name].run
    dev = as_device_info(device).torch_device
    q, k, v, go, _ = _inputs(tuple(shape), dtype, dev, False, seed=1)
    _fwd_bwd(run, q, k, v, go.contiguous(), None)  # fixes the gradient layout where the fault is
    go_tokens = go.transpose(1, 2).contiguous().transpose(1, 2)  # the same values in [B, L, H, D] memory
    got = _fwd_bwd(run, q, k, v, go_tokens, None)[1:]
    want = _fwd_bwd(BACKENDS["sdpa_math"].run, *(t.float() for t in (q, k, v, go)), None)[1:]
    return _rel_err(got, want)


def chosen(results: Sequence[BackendResult]) -> str | None:
    return next((r.name for r in results if r.chosen), None)


def describe(results: Sequence[BackendResult]) -> str:
    """The probe's results in one line: the correct backends by time, then why the others were rejected."""
    ok = ", ".join(f"{r.name} {r.ms_fwd_bwd:.3g} ms" for r in results if r.ok and r.ms_fwd_bwd is not None)
    rejected = "; ".join(f"{r.name}: {r.error}" for r in results if not r.ok)
    parts = (f"fwd+bwd: {ok}" if ok else "", f"rejected: {rejected}" if rejected else "")
    return "; ".join(p for p in parts if p)
