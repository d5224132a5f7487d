"""A single-process run without accelerate's launcher process (launcher.direct, the default).

For one process `accelerate launch` only works out an environment (ACCELERATE_MIXED_PRECISION, the dynamo keys,
OMP_NUM_THREADS, ...) and starts `python -m flux_trainer.sdscripts.runner` with it, then waits: a third Python
process that imports torch at every start (2.4-3.2 s of a start on the lent H200, ~1 s on a 2-core CPU). Here
accelerate's own parser, checks and environment builder run in the launcher instead, on the same command line, and the
training process is started directly with what accelerate would have given it. Where accelerate would pick another
launcher (several processes, DeepSpeed, FSDP, TPU, SageMaker) or its functions are not the ones this expects,
`accelerate launch` runs as written in command.txt.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Mapping

LAUNCH_MODULE = "accelerate.commands.launch"


def direct_command(cmd: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """The training process's command and environment as `cmd` (`python -m accelerate.commands.launch ...`) would
    start it from `env`, or None where accelerate would not use its simple launcher for it or cannot be asked."""
    if len(cmd) < 4 or cmd[1:3] != ["-m", LAUNCH_MODULE]:
        return None
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_simple_launcher_cmd_env
    except ImportError:
        return None
    try:
        with _environ(env), contextlib.redirect_stdout(io.StringIO()):
            args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
            if not _simple(args, defaults):
                return None
            child, child_env = prepare_simple_launcher_cmd_env(args)
    except (Exception, SystemExit):  # noqa: BLE001 - accelerate itself then says what is wrong, as it always did
        return None
    if child and child[0] == sys.executable:  # accelerate starts the child with its own interpreter: cmd's
        child = [cmd[0], *child[1:]]
    return child, dict(child_env)


def _simple(args, defaults) -> bool:
    """accelerate's launch_command would call simple_launcher (its branches, in its order)."""
    cpu = bool(getattr(args, "cpu", False))
    for other in ("use_deepspeed", "use_fsdp", "use_megatron_lm", "multi_gpu", "tpu"):
        if getattr(args, other, False) and not cpu:
            return False
    if defaults is not None and str(getattr(defaults, "compute_environment", "")).endswith("AMAZON_SAGEMAKER"):
        return False
    processes = getattr(args, "num_processes", None)
    return (processes is None or int(processes) <= 1) and int(getattr(args, "num_machines", 1) or 1) <= 1


@contextlib.contextmanager
def _environ(env: Mapping[str, str]):
    """os.environ is `env` for the block (accelerate reads and copies it), then what it was."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
