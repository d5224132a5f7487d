"""Attention backend choice: every backend that can run here, measured forward+backward at the real shape,
checked against a float32 math reference, the fastest correct one chosen, the verdict cached on disk.

A backend maps post-RoPE q, k, v [B, H, L, D] and an optional boolean mask [B, H, Lq, Lk] (True = attend, as
sd-scripts builds it) to [B, H, L, D]. SageAttention is listed so the reason is visible, but it has no backward
pass and is never selected for training.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_kernels import attention_fa4
from flux_kernels.device import as_device_info
from flux_kernels.timing import queued_ms

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
SAGE_REASON = "SageAttention has no backward pass (inference only); never selected for training"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    run: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
    requires: str = ""  # importable module it needs ("" = torch only)
    install: str = ""  # what to pip install for it, named where it is missing on a card it would run on
    cuda_only: bool = True
    trainable: bool = True
    note: str = ""
    quadratic: bool = False  # materialises the [B, H, L, L] attention weights (memory grows with L^2)
    sdpa_kind: str | None = None  # an SDPA backend (SDPBackend member name): compiled code gets it from outside
    op: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] | None = None  # custom ops compiled code may call
    min_capability: tuple[int, int] | None = None  # the CUDA compute capability it needs
    # the same attention as tokens [B, L, H*D] without a copy, taking its gradient in any layout (custom ops, so
    # compiled code calls it too); None: `heads_to_tokens` over the [B, H, L, D] output
    tokens: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] | None = None

    @property
    def compilable(self) -> bool:
        """Usable by compiled blocks: PyTorch's SDPA, with the backend set around the compiled call, or a backend
        made of custom ops (traced as they are)."""
        return self.name == "sdpa" or self.sdpa_kind is not None or self.op is not None

    def backend_context(self) -> contextlib.AbstractContextManager:
        """The SDPA backend switch to hold around a compiled block's call (traced under it, the graph calls that
        backend's op). Entering `sdpa_kernel` inside traced code would work too, but puts a call torch's
        AOTAutograd cache cannot key into the graph: every such graph bypassed that cache, in every run."""
        return contextlib.nullcontext() if self.sdpa_kind is None else _sdpa_only(self.sdpa_kind)


@dataclass(frozen=True)
class BackendResult:
    name: str
    ok: bool
    error: str = ""
    max_err: float | None = None
    ms_fwd_bwd: float | None = None
    chosen: bool = False


@torch.library.custom_op("flux_kernels::heads_to_tokens", mutates_args=())
def heads_to_tokens(x: Tensor) -> Tensor:
    """An attention output [B, H, L, D] as tokens [B, L, H*D] (sd-scripts' "B H L D -> B L (H D)", the same copy), whose
    backward hands the attention a contiguous [B, H, L, D] gradient.

    Why: PyTorch's cuDNN attention caches its backward graph per shape and q/k/v layout but not per layout of the
    incoming gradient (measured on torch 2.11 + cuDNN 9.19, H200): the first backward at a shape fixes the gradient
    layout, and a later call at that shape with the gradient in another layout gets dq/dk/dv that are simply wrong
    (errors of 100% and more), silently. The attention probe runs at the run's shape with a contiguous gradient before
    training, while the gradient of a plain transpose + flatten comes back transposed: the double blocks' attention got
    wrong gradients (the single blocks' v is a view of qkv: another cache entry). With this op every block attention's
    backward gets the probe's layout, on every backend. (The other way round holds too: code that passes another layout
    first at the same shape, such as sd-scripts' own blocks beside these in one process, makes these wrong; training
    never does that.) A custom op rather than an autograd.Function: torch.compile's AOTAutograd cache keys custom ops,
    while an autograd.Function in a graph makes the cache bypass it."""
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format).flatten(2)


@heads_to_tokens.register_fake
def _(x: Tensor) -> Tensor:
    B, H, L, D = x.shape
    return x.new_empty((B, L, H * D))


def _heads_to_tokens_setup(ctx, inputs, output) -> None:
    ctx.heads = inputs[0].shape[1]


def _heads_to_tokens_backward(ctx, grad: Tensor) -> Tensor:
    B, L, _ = grad.shape
    return grad.reshape(B, L, ctx.heads, -1).transpose(1, 2).contiguous()


heads_to_tokens.register_autograd(_heads_to_tokens_backward, setup_context=_heads_to_tokens_setup)


def _sdpa_only(kind: str) -> contextlib.AbstractContextManager:
    """PyTorch's SDPA switched to one of its backends (`kind`, an SDPBackend member name) while held."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, kind)])


def _sdpa_backend(name: str, kind: str, **options) -> AttentionBackend:
    """PyTorch's SDPA restricted to one of its backends (`kind`)."""

    def run(q, k, v, mask):
        with _sdpa_only(kind):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return AttentionBackend(name, run, sdpa_kind=kind, **options)


def _default_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _xformers(q, k, v, mask):
    import xformers.ops as xops

    bias = None
    if mask is not None:  # xformers wants an additive bias whose last dim is padded to a multiple of 8
        B, H, Lq, Lk = mask.shape
        pad = (Lk + 7) // 8 * 8
        bias = q.new_zeros(B, H, Lq, pad)[..., :Lk]
        bias.masked_fill_(~mask, float("-inf"))
    out = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias)
    return out.transpose(1, 2)


def _flash_attn(q, k, v, mask):
    if mask is not None:
        raise NotImplementedError("flash-attn's dense API takes no attention mask")
    from flash_attn import flash_attn_func

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _sage(q, k, v, mask):
    raise NotImplementedError(SAGE_REASON)


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("sdpa", _default_sdpa, cuda_only=False, note="PyTorch's own choice (sd-scripts' path)"),
        _sdpa_backend("sdpa_cudnn", "CUDNN_ATTENTION"),
        _sdpa_backend("sdpa_flash", "FLASH_ATTENTION", cuda_only=False),
        _sdpa_backend("sdpa_efficient", "EFFICIENT_ATTENTION"),
        _sdpa_backend("sdpa_math", "MATH", cuda_only=False, quadratic=True),
        AttentionBackend("xformers", _xformers, requires="xformers"),
        AttentionBackend("flash_attn", _flash_attn, requires="flash_attn"),
        AttentionBackend("sage", _sage, requires="sageattention", trainable=False, note=SAGE_REASON),
        AttentionBackend(
            "cudnn_fa4",
            attention_fa4.cudnn_fa4,
            requires=attention_fa4.MODULE,
            install=attention_fa4.DISTRIBUTION,
            op=attention_fa4.cudnn_fa4,
            min_capability=attention_fa4.MIN_CAPABILITY,
            tokens=attention_fa4.cudnn_fa4_tokens,
            note="cuDNN's forward, FlashAttention-4's backward (flash-attn-4)",
        ),
    )
}


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


def without_cudnn() -> contextlib.AbstractContextManager:
    """SDPA with every backend but cuDNN's, for sd-scripts' own blocks run beside patched ones at one shape.
    PyTorch's cuDNN attention keys its cached backward without the incoming gradient's layout (`heads_to_tokens`),
    and sd-scripts' blocks hand back another layout than the patched ones: in one process, whichever ran second at
    a shape got wrong gradients. `patch.verify_blocks` runs its reference under this, so the attention probe at the
    verify shape (the patched block's first call there) finds cuDNN as it is."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def chosen(results: Sequence[BackendResult]) -> str | None:
    return next((r.name for r in results if r.chosen), None)


def _isolated(fn: Callable, *args, **kwargs):
    """Run fn(*args, **kwargs) in a fresh thread and return its result (or raise its exception there).

    The attention probe runs at the first eager call of a new shape, i.e. inside some block's forward. Grad mode,
    autocast and saved-tensor hooks are thread-local, so the probe sees none of the caller's: gradient
    checkpointing's hooks do not record the probe's own tensors (the original forward and its recomputation then
    save the same tensors), a no_grad or autocast context around the forward does not change the probe's verdict,
    and the probe's backward passes happen in its own autograd graph."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread below
            box["error"] = e

    worker = threading.Thread(target=target, name="flux_kernels-attention-probe", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _probe_on(device: torch.device, *args, **kwargs) -> list[BackendResult]:
    """probe_attention with `device` as the thread's current CUDA device (events time on its stream)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return probe_attention(*args, **kwargs)
    return probe_attention(*args, **kwargs)


def _fallback(results: Sequence[BackendResult], shape, dtype: torch.dtype, dev: torch.device, with_mask: bool) -> str:
    """What runs where no probed backend passed: PyTorch's own SDPA, unless it was probed and failed too. Then
    nothing correct is left (the math backend was not tried, its weights too large, or failed as well), and
    KernelError says so: a rejected backend is never used, and training on wrong attention gradients would
    only look like training."""
    if not any(r.name == "sdpa" for r in results):
        return "sdpa"
    from flux_kernels.patch import KernelError

    where = f"{tuple(shape)} {str(dtype).removeprefix('torch.')} mask={with_mask} on {as_device_info(dev).name}"
    raise KernelError(
        f"attention: no backend is correct at {where} ({describe(results)}). PyTorch's own SDPA, which sd-scripts "
        "calls with the kernels off too, is among them: this PyTorch build's attention is wrong or broken on this GPU"
    )


class AttentionDispatch:
    """Callable (q, k, v, mask) -> [B, H, L, D] that uses the backend chosen by measurement.

    Eager calls use the backend chosen for their exact shape, dtype, device and mask: the first call at a new shape
    probes (in a thread of its own, see `_isolated`); later calls, and the recomputation of a checkpointed forward,
    reuse that choice. A call on another device than the one training runs on (`device`; `verify_blocks` runs the
    blocks on tiny inputs wherever the model is, often the CPU) uses PyTorch's SDPA and probes nothing: a verdict
    there says nothing about the GPU, and the math backend it may pick would materialise [B, H, L, L] weights at
    4608 tokens.

    Compiled code (regional torch.compile of the blocks) never probes while tracing: it uses `run_choice`, the
    backend that `decide_run` chose at the run's first real forward (called from a forward pre-hook on the model,
    see `flux_kernels.patch`, before any block is traced), for every shape; only SDPA backends qualify there
    (others would break the graph), else PyTorch's own SDPA. One attribute, set once, rather than a lookup per
    shape: torch.compile guards on what traced code reads, and a table that gains an entry for each new bucket
    shape would make every compiled block recompile."""

    def __init__(
        self,
        cache_path: Path | str | None = None,
        backends: Mapping[str, AttentionBackend] | None = None,
        device=None,
    ):
        self.cache_path = cache_path
        self.backends = BACKENDS if backends is None else backends
        self.device = None if device is None else as_device_info(device).torch_device
        self.choice: dict[tuple, str] = {}
        self.run_choice: str | None = None
        self.run_line: str | None = None  # what decide_run chose and why, for the run's log and TensorBoard

    @staticmethod
    def key(q: Tensor, k: Tensor, mask: Tensor | None) -> tuple:
        return (tuple(q.shape), k.shape[2], q.dtype, q.device, mask is not None)

    @staticmethod
    def shape_key(shape: Sequence[int], dtype: torch.dtype, device, with_mask: bool) -> tuple:
        """`key` of a self-attention call at `shape` (keys as long as queries)."""
        return (tuple(shape), shape[2], dtype, as_device_info(device).torch_device, with_mask)

    def prepare(self, shape: Sequence[int], dtype: torch.dtype, device, with_mask: bool) -> str:
        dev = as_device_info(device).torch_device
        start = time.perf_counter()
        results = _isolated(
            _probe_on, dev, tuple(shape), dtype, dev, with_mask, backends=self.backends, cache_path=self.cache_path
        )
        took = time.perf_counter() - start  # a cached verdict's: its choice's check (and first call) alone
        name = chosen(results) or _fallback(results, shape, dtype, dev, with_mask)
        log.info("attention %s %s mask=%s: %s (%s; %.1f s)", tuple(shape), dtype, with_mask, name,
                 describe(results) or "nothing ran", took)  # fmt: skip
        self.choice[self.shape_key(shape, dtype, dev, with_mask)] = name
        return name

    def decide_run(self, shape: Sequence[int], dtype: torch.dtype, device, with_mask: bool) -> str:
        """Choose the backend compiled blocks use, by a probe at the run's real shape (cached on disk)."""
        name = self.choice.get(self.shape_key(shape, dtype, device, with_mask))
        name = name or self.prepare(shape, dtype, device, with_mask)
        backend = self.backends.get(name)
        self.run_choice = name if backend is not None and backend.compilable else "sdpa"
        self.run_line = f"{name} at {tuple(shape)} {str(dtype).removeprefix('torch.')} mask={with_mask}"
        if self.run_choice != name:
            self.run_line += f"; compiled blocks use sdpa ({name} is not compiled)"
        self._agree_with_rank_zero()
        return self.run_choice

    def _agree_with_rank_zero(self) -> None:
        """Several processes (one per GPU): each probed on its own GPU, and timing noise can make them choose
        differently (cuDNN and PyTorch's own choice are within 2% on the H200); every rank takes rank 0's verdict, so
        all of them run the same attention. A collective: every rank gets here at its model's first forward."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        verdict = [self.run_choice, self.run_line]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] != self.run_choice:
            rank = dist.get_rank()
            log.info("attention: rank %d uses rank 0's choice %s (its own: %s)", rank, verdict[0], self.run_choice)
        self.run_choice, self.run_line = verdict

    def compiled_context(self) -> contextlib.AbstractContextManager:
        """Held around every call of a compiled block (flux_kernels.compile_blocks): the run's SDPA backend, which
        the traced code then calls (it uses plain SDPA itself)."""
        return self.backends.get(self.run_choice or "sdpa", BACKENDS["sdpa"]).backend_context()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        _, fn = self._pick(q, k, mask)
        return fn(q, k, v, mask)

    def tokens(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """The attention as tokens [B, L, H*D] (sd-scripts' "B H L D -> B L (H D)"), what the blocks call: the
        backend's own tokens form where it has one (no copy), else `heads_to_tokens` over its output."""
        backend, fn = self._pick(q, k, mask)
        if backend.tokens is not None:
            return backend.tokens(q, k, v, mask)
        return heads_to_tokens(fn(q, k, v, mask))

    def _pick(self, q: Tensor, k: Tensor, mask: Tensor | None) -> tuple[AttentionBackend, Callable]:
        """The backend for this call and what to call of it."""
        if torch.compiler.is_compiling():
            backend = self.backends.get(self.run_choice or "sdpa")
            if backend is not None and backend.op is not None:
                return backend, backend.op  # custom ops, traced as they are
            name = "sdpa"  # an SDPA backend is set around the compiled call: compiled_context
        else:
            name = self.choice.get(self.key(q, k, mask))
            if name is None:
                elsewhere = self.device is not None and q.device != self.device
                cross = q.shape[2] != k.shape[2]
                name = "sdpa" if elsewhere or cross else self.prepare(q.shape, q.dtype, q.device, mask is not None)
        backend = self.backends.get(name, BACKENDS["sdpa"])
        return backend, backend.run


def describe(results: Sequence[BackendResult]) -> str:
    """The probe's results in one line: the correct backends by time, then why the others were rejected."""
    ok = ", ".join(f"{r.name} {r.ms_fwd_bwd:.3g} ms" for r in results if r.ok and r.ms_fwd_bwd is not None)
    rejected = "; ".join(f"{r.name}: {r.error}" for r in results if not r.ok)
    parts = (f"fwd+bwd: {ok}" if ok else "", f"rejected: {rejected}" if rejected else "")
    return "; ".join(p for p in parts if p)
