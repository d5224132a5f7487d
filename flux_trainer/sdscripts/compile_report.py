"""What torch.compile did during a run, in one line: cache hits, misses and bypasses (with the reasons torch logs),
seconds spent compiling and where they went, and the CUDA-graph skips; read from torch's own counters."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("flux_trainer.runner")


def compile_cache_counts() -> dict[str, int]:
    """torch.compile's cache outcomes in this process so far: inductor's FX graph cache (the generated kernels of
    a graph) and AOTAutograd's (a graph's forward and backward), each hit / miss / bypass."""
    from torch._dynamo.utils import counters

    return {
        f"{name}_{outcome}": int(counters[group][f"{prefix}{outcome}"])
        for name, group, prefix in (
            ("inductor", "inductor", "fxgraph_cache_"),
            ("autograd", "aot_autograd", "autograd_cache_"),
        )
        for outcome in ("hit", "miss", "bypass")
    }


# torch's loggers that say why a graph bypasses a compile cache, and how their messages start (INFO level)
CACHE_BYPASS_LOGGERS = {
    "torch._inductor.codecache": ("inductor", "Bypassing FX Graph Cache because"),
    "torch._functorch._aot_autograd.autograd_cache": ("autograd", "Bypassing autograd cache due to"),
}


class CacheBypassReasons(logging.Filter):
    """Collects the reasons torch gives, at INFO on its own loggers, for a graph bypassing the compile caches, so
    the run log can say why instead of pointing at TORCH_LOGS. The loggers are lowered to INFO for this; records
    below the level they had (what the user would have seen, e.g. through TORCH_LOGS) are dropped here."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: dict[str, int] = {}
        self._shown: dict[str, int] = {}  # each logger's effective level before: what the user sees
        self._own: dict[str, int] = {}  # and its own level, put back by remove()

    def install(self) -> CacheBypassReasons:
        for name in CACHE_BYPASS_LOGGERS:
            logger = logging.getLogger(name)
            self._shown[name] = logger.getEffectiveLevel()
            self._own[name] = logger.level
            if self._shown[name] > logging.INFO:
                logger.setLevel(logging.INFO)
            logger.addFilter(self)
        return self

    def remove(self) -> None:
        for name, level in self._own.items():
            logger = logging.getLogger(name)
            logger.removeFilter(self)
            logger.setLevel(level)
        self._shown, self._own = {}, {}

    def filter(self, record: logging.LogRecord) -> bool:
        cache, prefix = CACHE_BYPASS_LOGGERS.get(record.name, ("", "\0"))
        message = record.getMessage()
        if message.startswith(prefix):
            reason = f"{cache}: " + " ".join(message[len(prefix) :].split()).strip(" :'")  # torch's has newlines
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return record.levelno >= self._shown.get(record.name, logging.NOTSET)


def compile_seconds() -> float | None:
    """Seconds torch.compile has spent compiling in this process (tracing, AOTAutograd and inductor, cache hits'
    loading included; forward and backward), None where this torch does not say."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent()["total_wall_time"])
    except Exception:  # noqa: BLE001 - a private API: a torch without it only loses the number
        return None


# Where torch.compile's seconds go, from torch's own timers (torch._dynamo.utils.compilation_time_metrics: seconds
# per call of each timed function; private, so a torch without them only loses the breakdown). They do not nest in
# one another; what they leave out (AOTAutograd's tracing and partitioning, cache lookups) is shown as "other".
COMPILE_PHASES = (
    ("tracing", ("bytecode_tracing",)),  # dynamo running the blocks' Python bytecode
    ("compiling", ("compile_fx_inner",)),  # inductor: generating and compiling kernels, or its FX graph cache
    ("loading cached code", ("AOTAutogradCache.inductor_load",)),  # a whole forward/backward from the cache
    ("cache keys", ("inductor_codecache_torch_key", "CacheBase.get_system.triton_key")),  # torch's, Triton's hashes
    ("guards", ("build_guards",)),
)


def compile_phases() -> dict[str, float]:
    """Seconds spent so far in each of COMPILE_PHASES (empty where this torch does not time them)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as timed
    except ImportError:
        return {}
    return {name: float(sum(sum(timed.get(key, ())) for key in keys)) for name, keys in COMPILE_PHASES}


@dataclass(frozen=True)
class CompileState:
    counts: dict[str, int]
    seconds: float | None
    phases: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def now() -> CompileState:
        return CompileState(compile_cache_counts(), compile_seconds(), compile_phases())

    def graphs(self) -> int:
        """Forward/backward graphs through AOTAutograd so far, from its cache or not."""
        return sum(self.counts.get(f"autograd_{outcome}", 0) for outcome in ("hit", "miss", "bypass"))


def _phase_breakdown(seconds: float, phases: dict[str, float]) -> str:
    """ " (tracing 1.3 s, loading cached code 1.5 s, ..., other 0.3 s)": the phases of at least 0.05 s."""
    shown = [(name, t) for name, t in phases.items() if t >= 0.05]
    if (other := seconds - sum(phases.values())) >= 0.05 and shown:
        shown.append(("other", other))
    return f" ({', '.join(f'{name} {t:.1f} s' for name, t in shown)})" if shown else ""


def report_compile_cache(
    bypass_reasons: dict[str, int] | None = None,
    now: CompileState | None = None,
    since: CompileState | None = None,
    step: int | None = None,
    before: CompileState | None = None,
) -> str:
    """After the first step: how much of the compiling came from the cache (a second run of the same shapes
    should be all hits), how long it took and where that went, and why some of it cannot be cached (torch's
    reasons, when they were collected). `before`: the state when training started, so the line counts the first
    step's own compiling and names what was compiled before it apart (the registry's compile probe). With `since`:
    what was compiled after that (at `step`). Logged, and returned for TensorBoard."""
    now = now or CompileState.now()
    since = since or before
    c = {k: v - (since.counts.get(k, 0) if since else 0) for k, v in now.counts.items()}
    seconds = now.seconds - (since.seconds or 0.0) if since and now.seconds is not None else now.seconds
    phases = {k: v - (since.phases.get(k, 0.0) if since else 0.0) for k, v in now.phases.items()}
    head = "torch.compile cache" if step is None else f"torch.compile at step {step}, compiled again: cache"
    line = f"{head}: " + ", ".join(
        f"{n} {c[n + '_hit']} hit / {c[n + '_miss']} miss / {c[n + '_bypass']} bypass" for n in ("inductor", "autograd")
    )
    if seconds is not None:
        line += f"; {seconds:.1f} s compiling" + _phase_breakdown(seconds, phases)
    if before is not None and before.graphs() and before.seconds is not None:
        line += f"; before training {before.graphs()} graph(s), {before.seconds:.1f} s (kernel probes)"
    if c["inductor_bypass"] or c["autograd_bypass"]:
        why = "; ".join(f"{reason} ({n}x)" for reason, n in (bypass_reasons or {}).items())
        why = f"torch says: {why}" if why else "TORCH_LOGS=aot,inductor says why"
        line += f"; a bypassed graph is compiled anew in every run ({why})"
        log.warning(line)
    else:
        log.info(line)
    return line


def cudagraph_skips() -> int:
    """How many compiled graphs inductor ran without CUDA graphs (it logs why under TORCH_LOGS=cudagraphs)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])
