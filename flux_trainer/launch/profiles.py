"""Environment profiles: the variables the training child starts with, per GPU family, each with its reason.

One table (`TABLE`), read top to bottom: a variable, the families it applies to, how its value is chosen and why.
`environment_profile` is pure: it takes the device as data and the user's environment as a mapping, so every
family is testable on a CPU machine. A value the user already set wins and is recorded with what we would have used.
What was applied goes to the run dir as `env.json` (`profile_json`) and is shown once at start (`profile_lines`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flux_trainer.launch.device import DeviceInfo

# Read by flux_trainer.sdscripts.runner: "1" -> torch.backends.cuda.matmul.allow_tf32 = True and
# torch.backends.cudnn.allow_tf32 = True before the model is built. NVIDIA_TF32_OVERRIDE is not the switch:
# it can only force TF32 *off* ("0") process-wide, so we never set it.
TF32_ENV = "FLUX_TRAIN_TF32"

# Cards with at most this much VRAM (GiB as torch reports it: a "24 GB" RTX 4090 shows 23.6) get the GC threshold.
SMALL_CARD_GIB = 25.0

_CUDA = frozenset({"blackwell_consumer", "blackwell", "hopper", "ada", "ampere", "older"})
_TF32 = frozenset({"blackwell_consumer", "blackwell", "hopper", "ada", "ampere"})  # sm_80+: TF32 tensor cores
_ALL = frozenset({*_CUDA, "rocm", "cpu"})
_SM90 = frozenset({"blackwell_consumer", "blackwell", "hopper"})  # where flash-attn-4 (the cudnn_fa4 backend) runs


@dataclass(frozen=True)
class _Context:
    info: DeviceInfo
    gpus: int
    cache_dir: Path
    cpu_threads: int


@dataclass(frozen=True)
class EnvRule:
    """One row of the table: `value` returns None where the rule does not apply to this device/run."""

    name: str
    families: frozenset[str]
    value: Callable[[_Context], str | None]
    reason: str
    aliases: tuple[str, ...] = ()  # other names a user may have set for the same thing (their value wins)


def _alloc_conf(c: _Context) -> str:
    conf = "expandable_segments:True"
    if c.info.vram_gib <= SMALL_CARD_GIB:
        conf += ",garbage_collection_threshold:0.8"
    return conf


def _arch_list(c: _Context) -> str | None:
    cap = c.info.capability
    if cap is None:
        return None
    return f"{cap[0]}.{cap[1]}"  # this card only: "12.0" RTX 50xx, "9.0" H100, "8.9" RTX 40xx, "8.6" RTX 30xx


def _flash_attn_cache(c: _Context) -> str | None:
    cap = c.info.capability
    return None if cap is None else str(c.cache_dir / "flash_attn_cute" / f"sm{cap[0]}{cap[1]}")


def _consumer_multi_gpu(c: _Context) -> str | None:
    return "1" if c.gpus > 1 and not c.info.peer_to_peer else None


TABLE: tuple[EnvRule, ...] = (
    EnvRule(
        "PYTORCH_CUDA_ALLOC_CONF",
        _CUDA,
        _alloc_conf,
        "expandable_segments: aspect-ratio buckets change activation shapes every step, growable segments stop "
        "fragmentation OOMs; <= 24 GB cards also garbage_collection_threshold:0.8 to free cached blocks early",
        aliases=("PYTORCH_ALLOC_CONF",),
    ),
    EnvRule(
        TF32_ENV,
        _TF32,
        lambda c: "1",
        "the runner enables TF32 matmuls/convolutions: fp32 work (LoRA weights, optimizer, VAE) on tensor cores; "
        "bf16 autocast is unaffected",
    ),
    EnvRule(
        "TORCH_CUDA_ARCH_LIST",
        _CUDA,
        _arch_list,
        "extensions built on this machine (xformers, flash-attn, custom ops) compile only for this card: shorter "
        "builds, no 'no kernel image' at run time",
    ),
    EnvRule(
        "NCCL_P2P_DISABLE",
        _CUDA,
        _consumer_multi_gpu,
        "GeForce RTX 40xx/50xx have no GPU peer-to-peer; NCCL can hang or corrupt trying it",
    ),
    EnvRule(
        "NCCL_IB_DISABLE",
        _CUDA,
        _consumer_multi_gpu,
        "no InfiniBand in a consumer box; skip the probe (as accelerate does for RTX 40xx)",
    ),
    EnvRule(
        "CUDA_MODULE_LOADING",
        _CUDA,
        lambda c: "LAZY",
        "load CUDA kernels on first use: faster start, less host and GPU memory (torch's default, made visible)",
    ),
    EnvRule(
        "OMP_NUM_THREADS",
        _ALL,
        lambda c: str(c.cpu_threads),
        "CPU threads per training process (launcher.cpu_threads_per_process) so N processes do not oversubscribe "
        "the cores; accelerate sets it from --num_cpu_threads_per_process",
    ),
    EnvRule(
        "TOKENIZERS_PARALLELISM",
        _ALL,
        lambda c: "false",
        "Hugging Face tokenizers' threads and forked data loader workers: silences the fork warning, avoids the "
        "deadlock it warns about",
    ),
    EnvRule(
        "PYTHONUNBUFFERED",
        _ALL,
        lambda c: "1",
        "the child writes into a pipe: unbuffered output reaches the screen and train.log as it happens",
    ),
    EnvRule(
        "TORCHINDUCTOR_CACHE_DIR",
        _ALL,
        lambda c: str(c.cache_dir / "torchinductor"),
        "torch.compile artefacts persist in flux-train's cache (default /tmp is wiped): later runs skip most of "
        "the compile time",
    ),
    EnvRule(
        "TRITON_CACHE_DIR",
        _CUDA,
        lambda c: str(c.cache_dir / "triton"),
        "compiled Triton kernels persist beside the inductor cache and are reused between runs",
    ),
    EnvRule(
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
        _SM90,
        lambda c: "1",
        "flash-attn-4 (the cudnn_fa4 attention backend, where installed) keeps the kernels it compiles for each "
        "shape on disk: a later run loads them instead of compiling them again; no effect without flash-attn-4",
    ),
    EnvRule(
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
        _SM90,
        _flash_attn_cache,
        "flash-attn-4's compiled kernels beside the inductor and Triton caches (its default is under /tmp), a folder "
        "per compute capability: some of its cache keys leave the GPU out, and a cache folder may be shared by nodes "
        "with other cards",
    ),
)


@dataclass(frozen=True)
class EnvRecord:
    """One variable as applied: value in effect, why, and who chose it ("profile" or "user")."""

    name: str
    value: str
    reason: str
    source: str
    profile_value: str | None = None  # what the profile would have set, when the user's own value won


@dataclass
class Profile:
    """The variables flux-train sets or keeps for the child (merge over os.environ), and the record of each."""

    env: dict[str, str] = field(default_factory=dict)
    records: list[EnvRecord] = field(default_factory=list)


def environment_profile(
    info: DeviceInfo, user_env: Mapping[str, str], *, gpus: int, cache_dir: Path, cpu_threads: int = 2
) -> Profile:
    """The profile for this device and run: every applicable rule of `TABLE`, the user's own values kept.

    `gpus` is processes per node (multi-GPU settings apply only above 1). `cpu_threads` should be the
    `--num_cpu_threads_per_process` the command will carry (launcher.cpu_threads_per_process); when the user set
    OMP_NUM_THREADS, pass `int(profile.env["OMP_NUM_THREADS"])` to the command instead, as accelerate overwrites it.
    """
    ctx = _Context(info=info, gpus=gpus, cache_dir=Path(cache_dir), cpu_threads=cpu_threads)
    profile = Profile()
    for rule in TABLE:
        if info.family not in rule.families:
            continue
        ours = rule.value(ctx)
        if ours is None:
            continue
        user_name = next((n for n in (rule.name, *rule.aliases) if n in user_env), None)
        if user_name is None:
            profile.env[rule.name] = ours
            profile.records.append(EnvRecord(rule.name, ours, rule.reason, "profile"))
        else:
            profile.env[user_name] = user_env[user_name]
            profile.records.append(EnvRecord(user_name, user_env[user_name], rule.reason, "user", ours))
    return profile


def profile_json(profile: Profile, info: DeviceInfo) -> dict:
    """The content of the run dir's `env.json`: the device, the variables, and each one's reason and source."""
    return {
        "device": asdict(info),
        "env": dict(profile.env),
        "records": [asdict(r) for r in profile.records],
    }


def profile_lines(profile: Profile) -> list[str]:
    """What is shown once at start: one line per variable, the user's overrides marked."""
    lines = []
    for r in profile.records:
        mark = f"  (yours; profile: {r.profile_value})" if r.source == "user" else ""
        lines.append(f"{r.name}={r.value}{mark}")
    return lines
