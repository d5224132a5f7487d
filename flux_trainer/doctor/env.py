"""Doctor checks of the software around the GPU: the sd-scripts checkout and the versions of what it imports, and
environment variables that make training crash or crawl.

Versions come from `importlib.metadata` (installed distributions' metadata): nothing heavy is imported to read a
version, so these checks run in milliseconds and are part of the pre-launch subset.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from importlib import metadata

from flux_trainer.config.errors import ConfigError
from flux_trainer.doctor.core import FAIL, PASS, WARN, CheckResult
from flux_trainer.launch.device import DeviceInfo

GROUP_SD, GROUP_ENV = "sd-scripts", "env"


# ---- sd-scripts ----------------------------------------------------------------------------------------------


def sd_scripts_check(configured: str | None, env: Mapping[str, str] = os.environ) -> CheckResult:
    """Found (config key, $FLUX_TRAIN_SD_SCRIPTS, cache folder) and at the pinned commit."""
    from flux_trainer.sdscripts import checkout

    try:
        found = checkout.locate(configured, env)
    except ConfigError as e:
        return CheckResult("sd-scripts", FAIL, str(e), "flux-train setup", GROUP_SD)
    data = {"path": str(found.path), "source": found.source, "commit": found.commit, "pinned": checkout.PINNED_COMMIT}
    if (warning := checkout.commit_warning(found)) is not None:
        return CheckResult(
            "sd-scripts", WARN, warning, f"git -C {found.path} checkout {checkout.PINNED_COMMIT[:10]}", GROUP_SD, data
        )
    return CheckResult(
        "sd-scripts", PASS, f"{found.path} (from {found.source}) at the pinned {found.commit[:10]}", "", GROUP_SD, data
    )


# (distribution names, the requirement as pip writes it, why). The first installed name is the one checked.
REQUIREMENTS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("transformers",), ">=4.54,<5", "transformers 5 removed CLIPFeatureExtractor, which sd-scripts imports"),
    (("diffusers",), "==0.32.*", "sd-scripts is pinned to 0.32.1; newer ones need transformers 5"),
    (("huggingface_hub", "huggingface-hub"), ">=0.34,<1", "diffusers 0.32 imports names hub 1.0 removed"),
    (("tokenizers",), ">=0.21,<0.22", "what transformers 4.54 accepts (it checks at import)"),
    (("accelerate",), ">=1.6", "sd-scripts' Accelerator arguments"),
    (("safetensors",), ">=0.4.5", "fp8 tensors in safetensors files"),
    (("toml",), "", "sd-scripts reads its TOML with it"),
    (("voluptuous",), "", "sd-scripts' dataset config schema"),
    (("imagesize",), "", "sd-scripts' bucket sizes"),
    (("ftfy",), "", "caption cleaning"),
    (("einops",), "", "FLUX model code"),
    (("sentencepiece",), "", "the T5 tokenizer"),
    (
        ("opencv-python-headless", "opencv-python", "opencv-contrib-python", "opencv-contrib-python-headless"),
        "",
        "image loading (cv2)",
    ),
    (("numpy",), "", ""),
    (("pillow",), "", ""),
)
# what a FLUX.2 / Kontext run (musubi-tuner) needs beyond sd-scripts' list: not asked of a FLUX.1 run
MUSUBI_REQUIREMENTS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("av",), "", "musubi-tuner's dataset module imports it (FLUX.2, Kontext)"),
)
OPTIMIZER_REQUIREMENTS = {
    "AdamW8bit": (("bitsandbytes",), ">=0.45", "8-bit AdamW (optimizer=adamw8bit)"),
    "Prodigy": (("prodigyopt",), "", "optimizer=prodigy"),
}


def _version(text: str) -> tuple[int, ...]:
    m = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def satisfies(version: str, spec: str) -> bool:
    """A small, dependency-free subset of PEP 440: comma-separated >=, <=, >, <, ==, != with `==X.Y.*`. Local and
    pre-release tags are ignored (4.54.1+cu128 counts as 4.54.1)."""
    have = _version(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, want_text = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)", clause).groups()
        if want_text.endswith(".*"):
            want = _version(want_text[:-2])
            same = have[: len(want)] == want
            if (op == "==" and not same) or (op == "!=" and same):
                return False
            continue
        want = _version(want_text)
        n = max(len(have), len(want))
        h, w = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        ok = {">=": h >= w, "<=": h <= w, ">": h > w, "<": h < w, "==": h == w, "!=": h != w}[op]
        if not ok:
            return False
    return True


def installed_version(names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def dependency_check(optimizer_type: str = "", version_of=None, musubi: bool = False) -> CheckResult:
    """sd-scripts' imports installed at versions it works with, and with `musubi` (a FLUX.2 / Kontext model)
    musubi-tuner's further ones (`version_of(names) -> (name, version) | None`, default `installed_version`, is
    replaceable for tests)."""
    version_of = installed_version if version_of is None else version_of
    wanted = list(REQUIREMENTS) + (list(MUSUBI_REQUIREMENTS) if musubi else [])
    if optimizer_type in OPTIMIZER_REQUIREMENTS:
        wanted.append(OPTIMIZER_REQUIREMENTS[optimizer_type])
    seen, problems, pins = [], [], []
    for names, spec, why in wanted:
        found = version_of(names)
        if found is None:
            problems.append(f"{names[0]} missing" + (f" ({why})" if why else ""))
            pins.append(f'"{names[0]}{spec}"')
            continue
        name, version = found
        seen.append(f"{name} {version}")
        if spec and not satisfies(version, spec):
            problems.append(f"{name} {version} (need {spec}: {why})")
            pins.append(f'"{names[0]}{spec}"')
    data = {"installed": seen, "problems": problems}
    if problems:
        return CheckResult(
            "sd-scripts deps", FAIL, "; ".join(problems), "pip install " + " ".join(pins), GROUP_SD, data
        )
    more = f" (+{len(seen) - 6} more)" if len(seen) > 6 else ""
    return CheckResult("sd-scripts deps", PASS, ", ".join(seen[:6]) + more, "", GROUP_SD, data)


# ---- environment ---------------------------------------------------------------------------------------------

ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# Every key PyTorch's CUDA caching allocator has accepted (c10 AllocatorConfig / CUDAAllocatorConfig, 2.1 - 2.11).
# An unknown key is not ignored: torch raises "Unrecognized CachingAllocator option" at the first CUDA allocation.
ALLOC_BOOL_KEYS = frozenset(
    {
        "expandable_segments",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_use_background_threads",
        "graph_capture_record_stream_reuse",
    }
)
ALLOC_KEYS = ALLOC_BOOL_KEYS | {
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "backend",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "per_process_memory_fraction",
}
_NATIVE_ONLY = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions")


def parse_alloc_conf(text: str) -> list[tuple[str, str]]:
    """`key:value,key:value` (a value may be a bracketed list with its own commas) into (key, value) pairs."""
    pairs, depth, item = [], 0, ""
    for ch in text.replace(" ", "") + ",":
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            if item:
                key, _, value = item.partition(":")
                pairs.append((key, value))
            item = ""
        else:
            item += ch
    return pairs


def _alloc_value_problem(key: str, value: str) -> tuple[str, str]:
    """(problem, fix) for one key's value; ('', '') when torch accepts it."""
    if key in ALLOC_BOOL_KEYS:
        if value in ("True", "False"):
            return "", ""
        fixed = "True" if value.lower() in ("true", "1", "yes", "on") else "False"
        return f"{key}:{value} must be True or False (capitalised)", f"write {key}:{fixed}"
    if key == "garbage_collection_threshold":
        try:
            ok = 0.0 < float(value) < 1.0
        except ValueError:
            ok = False
        return ("", "") if ok else (f"{key}:{value} must be between 0 and 1", f"write {key}:0.8")
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        ok = value.isdigit() and int(value) >= 20
        return ("", "") if ok else (f"{key}:{value} must be a whole number of MB >= 20", f"write {key}:512")
    if key == "backend" and value not in ("native", "cudaMallocAsync"):
        return f"backend:{value} is unknown", "write backend:native or backend:cudaMallocAsync"
    return ("", "") if value else (f"{key} has no value", f"write {key}:VALUE")


def flux_train_alloc_conf(info: DeviceInfo | None) -> str | None:
    """What flux-train's environment profile sets for this card when the user sets nothing (None on CPU)."""
    from flux_trainer.config.paths import cache_root
    from flux_trainer.launch.profiles import environment_profile

    if info is None:
        return None
    return environment_profile(info, {}, gpus=1, cache_dir=cache_root()).env.get(ALLOC_VARS[0])


def alloc_conf_check(env: Mapping[str, str], info: DeviceInfo | None = None) -> CheckResult:
    """PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF: misspelt keys (torch refuses to allocate), bad values, both set
    and different, native-only options under backend:cudaMallocAsync."""
    ours = flux_train_alloc_conf(info)
    set_vars = {n: env[n] for n in ALLOC_VARS if env.get(n)}
    if not set_vars:
        said = f"flux-train sets {ALLOC_VARS[0]}={ours}" if ours else "not used without a CUDA GPU"
        return CheckResult("env: allocator", PASS, f"not set: {said}", "", GROUP_ENV, {"flux_train": ours})
    fails, warns, fixes = [], [], []
    if len(set_vars) == 2 and parse_alloc_conf(set_vars[ALLOC_VARS[0]]) != parse_alloc_conf(set_vars[ALLOC_VARS[1]]):
        warns.append(
            f"both {' and '.join(ALLOC_VARS)} are set and differ: torch reads only one (which one depends "
            "on its version)"
        )
        fixes.append(f"unset one (torch 2.9+ reads {ALLOC_VARS[1]})")
    for name, text in set_vars.items():
        pairs = parse_alloc_conf(text)
        keys = [k for k, _ in pairs]
        for key, value in pairs:
            if key not in ALLOC_KEYS:
                close = difflib.get_close_matches(key, sorted(ALLOC_KEYS), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                fails.append(f"{name}: unknown key '{key}'{hint}: torch raises at the first CUDA allocation")
                fixes.append(f"in {name} write {close[0]} instead of {key}" if close else f"remove {key} from {name}")
            else:
                problem, fix = _alloc_value_problem(key, value)
                if problem:
                    fails.append(f"{name}: {problem}")
                    fixes.append(f"in {name} {fix}")
        if dupes := sorted({k for k in keys if keys.count(k) > 1}):
            warns.append(f"{name}: {', '.join(dupes)} given twice (the last one wins)")
            fixes.append(f"keep one {dupes[0]} in {name}")
        if dict(pairs).get("backend") == "cudaMallocAsync" and (ignored := [k for k in _NATIVE_ONLY if k in keys]):
            warns.append(f"{name}: backend:cudaMallocAsync ignores {', '.join(ignored)}")
            fixes.append(f"drop {', '.join(ignored)} or backend:cudaMallocAsync")
    shown = "; ".join(f"{n}={v}" for n, v in set_vars.items())
    data = {"vars": set_vars, "problems": fails + warns, "flux_train": ours}
    if fails or warns:
        status = FAIL if fails else WARN
        return CheckResult(
            "env: allocator", status, "; ".join(fails + warns) + f" [{shown}]", "; ".join(fixes), GROUP_ENV, data
        )
    note = ""
    if ours and not any("expandable_segments:True" in v for v in set_vars.values()):
        note = f" (yours replaces flux-train's {ours}: expandable segments avoid fragmentation OOMs with buckets)"
    return CheckResult("env: allocator", PASS, f"{shown}: valid{note}", "", GROUP_ENV, data)


# (variable, predicate on its value, what it does, fix)
_SLOW_OR_BROKEN = (
    (
        "CUDA_LAUNCH_BLOCKING",
        lambda v: v not in ("", "0"),
        "serialises every kernel launch: training crawls",
        "unset CUDA_LAUNCH_BLOCKING",
    ),
    (
        "PYTORCH_NO_CUDA_MEMORY_CACHING",
        lambda v: v not in ("", "0"),
        "disables the caching allocator: every tensor is a cudaMalloc, training crawls",
        "unset PYTORCH_NO_CUDA_MEMORY_CACHING",
    ),
    (
        "NVIDIA_TF32_OVERRIDE",
        lambda v: v == "0",
        "forces TF32 off process-wide: fp32 work (LoRA, optimizer, VAE) skips tensor cores",
        "unset NVIDIA_TF32_OVERRIDE",
    ),
    (
        "CUDA_VISIBLE_DEVICES",
        lambda v: v.strip() in ("", "-1", "none", "NoDevFiles"),
        "hides every GPU",
        "unset CUDA_VISIBLE_DEVICES or list the GPUs to use (e.g. 0)",
    ),
    (
        "TORCH_COMPILE_DISABLE",
        lambda v: v not in ("", "0"),
        "turns torch.compile off (compiled blocks are ~1.5x faster)",
        "unset TORCH_COMPILE_DISABLE",
    ),
)


def other_env_check(env: Mapping[str, str]) -> CheckResult:
    """Variables left over from debugging that crash or slow training."""
    found = [
        (f"{name}={env[name]!r}: {what}", fix)
        for name, bad, what, fix in _SLOW_OR_BROKEN
        if name in env and bad(env[name])
    ]
    if not found:
        names = ", ".join(n for n, *_ in _SLOW_OR_BROKEN)
        return CheckResult("env: other", PASS, f"none of {names} set to a harmful value", "", GROUP_ENV)
    return CheckResult(
        "env: other",
        WARN,
        "; ".join(w for w, _ in found),
        "; ".join(f for _, f in found),
        GROUP_ENV,
        {"found": [w for w, _ in found]},
    )


def env_checks(env: Mapping[str, str], info: DeviceInfo | None = None) -> list[CheckResult]:
    return [alloc_conf_check(env, info), other_env_check(env)]
