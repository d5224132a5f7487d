"""The supervisor with real child processes: exit codes, tee, signal forwarding and escalation, no shell."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flux_trainer.launch.supervise import explain_failure, run_supervised

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

SUPERVISOR = """
import sys
from pathlib import Path
from flux_trainer.launch.supervise import run_supervised
sys.exit(run_supervised(sys.argv[2:], None, Path(sys.argv[1])))
"""

# Exits 7 on SIGINT after leaving a marker: proves the signal reached it (it is in another session than ours).
CHILD_STOPS_ON_SIGINT = """
import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(7)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(30)
"""

# Ignores SIGINT and SIGTERM (saying so): only the third Ctrl-C's SIGKILL stops it.
CHILD_STUBBORN = """
import signal, sys, time
def note(signum, frame):
    print(f"got {signal.Signals(signum).name}", flush=True)
signal.signal(signal.SIGINT, note)
signal.signal(signal.SIGTERM, note)
print("ready", flush=True)
for _ in range(300):
    time.sleep(0.1)
"""


def wait_for(path: Path, text: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}: {path.read_text() if path.exists() else '(none)'}")


def start_supervisor(tmp_path: Path, child: str, *child_args: str) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "supervisor.py").write_text(SUPERVISOR)
    (tmp_path / "child.py").write_text(child)
    log = tmp_path / "train.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sup = subprocess.Popen(
        [PY, str(tmp_path / "supervisor.py"), str(log), PY, str(tmp_path / "child.py"), *child_args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(log, "ready")
    return sup, log


@pytest.mark.parametrize("code", [0, 3])
def test_exit_code_passes_through(tmp_path, code):
    out = io.StringIO()
    assert run_supervised([PY, "-c", f"import sys; sys.exit({code})"], None, tmp_path / "log", echo=out) == code


def test_the_training_process_own_code_is_reported_and_returned(tmp_path):
    """accelerate turns every failure into 1; the runner's own code (read back by `exit_code`) is what the failure
    summary says and what is returned, so the two never disagree."""
    out = io.StringIO()
    cmd = [PY, "-c", "import sys; sys.exit(1)"]
    assert run_supervised(cmd, None, tmp_path / "log", echo=out, exit_code=lambda c: 2 if c == 1 else c) == 2
    assert "training exited with code 2" in out.getvalue()


def test_signalled_child_reads_like_a_shell(tmp_path):
    cmd = [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    out = io.StringIO()
    assert run_supervised(cmd, None, tmp_path / "log", echo=out) == 128 + signal.SIGKILL
    assert "SIGKILL" in out.getvalue()


def test_output_is_teed_and_appended(tmp_path):
    log = tmp_path / "run" / "train.log"
    log.parent.mkdir()
    log.write_text("earlier run\n")
    cmd = [
        PY,
        "-c",
        "import sys; print('to stdout'); print('to stderr', file=sys.stderr); "
        "sys.stdout.write('bar 1\\rbar 2\\rdone\\n')",
    ]
    out = io.StringIO()
    assert run_supervised(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, log, echo=out) == 0
    assert out.getvalue() == "to stdout\nto stderr\nbar 1\rbar 2\rdone\n"
    with open(log, encoding="utf-8", newline="") as f:  # no newline translation: '\r' stays '\r'
        assert f.read() == "earlier run\n" + out.getvalue()


def test_environment_and_cwd_are_the_childs(tmp_path):
    cmd = [PY, "-c", "import os; print(os.environ['FLUX_X'], os.getcwd())"]
    out = io.StringIO()
    assert (
        run_supervised(cmd, {"FLUX_X": "42", "PATH": os.environ["PATH"]}, tmp_path / "log", cwd=tmp_path, echo=out) == 0
    )
    assert out.getvalue().split() == ["42", str(tmp_path)]


def test_shell_metacharacters_are_passed_literally(tmp_path):
    payload = "'; touch PWNED'"
    out = io.StringIO()
    code = run_supervised(
        [PY, "-c", "import sys; print(repr(sys.argv[1]))", payload], None, tmp_path / "log", cwd=tmp_path, echo=out
    )
    assert code == 0
    assert out.getvalue().strip() == repr(payload)
    assert not (tmp_path / "PWNED").exists()
    with pytest.raises(TypeError):
        run_supervised(f"{PY} -c pass", None, tmp_path / "log")  # type: ignore[arg-type]


def test_sigint_is_forwarded_to_the_child(tmp_path):
    marker = tmp_path / "marker"
    sup, log = start_supervisor(tmp_path, CHILD_STOPS_ON_SIGINT, str(marker))
    sup.send_signal(signal.SIGINT)
    assert sup.wait(timeout=20) == 7
    assert marker.read_text() == "SIGINT"
    text = log.read_text()
    assert "sending SIGINT" in text and "stopped on request" in text
    assert "cause:" not in text  # an interruption is not a failure to explain


def test_ctrl_c_escalates_to_sigterm_then_sigkill(tmp_path):
    sup, log = start_supervisor(tmp_path, CHILD_STUBBORN)
    sup.send_signal(signal.SIGINT)
    wait_for(log, "got SIGINT")
    sup.send_signal(signal.SIGINT)
    wait_for(log, "got SIGTERM")
    sup.send_signal(signal.SIGINT)
    assert sup.wait(timeout=20) == 128 + signal.SIGKILL
    assert "sending SIGKILL" in log.read_text()


def test_sigterm_to_us_is_forwarded_as_sigterm(tmp_path):
    sup, log = start_supervisor(tmp_path, CHILD_STUBBORN)
    sup.send_signal(signal.SIGTERM)
    wait_for(log, "got SIGTERM")
    assert "got SIGINT" not in log.read_text()
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=20) == 128 + signal.SIGKILL


def test_works_from_a_thread_without_forwarding(tmp_path):
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "rc", run_supervised([PY, "-c", "print('hi')"], None, tmp_path / "log", echo=io.StringIO())
        )
    )
    t.start()
    t.join(30)
    assert result == {"rc": 0}


def test_a_leaked_grandchild_holding_the_output_is_terminated(tmp_path):
    # The child exits at once; the grandchild it started keeps the pipe open for 60 s.
    cmd = [PY, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"]
    start = time.monotonic()
    out = io.StringIO()
    assert run_supervised(cmd, None, tmp_path / "log", echo=out, linger_s=0.5) == 0
    assert time.monotonic() - start < 15
    assert "sending SIGTERM" in out.getvalue()


def test_missing_executable_is_127(tmp_path):
    out = io.StringIO()
    assert run_supervised([str(tmp_path / "nope")], None, tmp_path / "log", echo=out) == 127
    assert "cannot start" in out.getvalue()


OOM_TAIL = [
    "steps:  12%|#2        | 180/1500 [03:10<23:15,  1.06s/it, avr_loss=0.412]",
    "Traceback (most recent call last):",
    '  File "flux_train_network.py", line 519, in <module>',
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
    "23.55 GiB of which 1.02 GiB is free.",
]


def test_explain_out_of_memory_names_the_next_smaller_preset():
    message = explain_failure(OOM_TAIL, "vram24")
    assert "ran out of memory" in message and "memory=vram16" in message
    assert "gradient_checkpointing" in message and "fp8_base" in message
    assert "memory=vram12" in explain_failure(OOM_TAIL, "vram16")
    assert "smallest" in explain_failure(OOM_TAIL, "vram8")


def test_explain_other_causes():
    assert "CUDA 12.8" in explain_failure(
        ["RuntimeError: CUDA error: no kernel image is available for execution on the device"], None
    )
    assert "pip install opencv-python-headless" in explain_failure(["ModuleNotFoundError: No module named 'cv2'"], None)
    assert "FLUX_TRAIN_SD_SCRIPTS" in explain_failure(["ModuleNotFoundError: No module named 'library'"], None)
    assert "NaN" in explain_failure(["steps: 5%| 75/1500 [01:10<22:00, avr_loss=nan]"], None)
    assert "not recognised" in explain_failure(["ValueError: something else"], None)


def test_explain_prefers_the_last_cause_in_the_log():
    tail = ["No module named 'xformers' (optional, using sdpa)", *OOM_TAIL]
    assert "ran out of memory" in explain_failure(tail, "vram24")


def test_failure_prints_the_tail_and_the_cause(tmp_path):
    script = "import sys\nfor i in range(30): print(f'line {i}')\nprint('" + OOM_TAIL[-1] + "')\nsys.exit(1)\n"
    out = io.StringIO()
    assert run_supervised([PY, "-c", script], None, tmp_path / "log", echo=out, memory_tier="vram32") == 1
    report = out.getvalue().split("---- last 20 lines")[1]
    assert "line 11" in report and "line 10" not in report  # exactly the last 20 lines
    assert "memory=vram24" in report and "exited with code 1" in report
    assert "memory=vram24" in (tmp_path / "log").read_text()


def test_progress_bar_redraws_do_not_push_real_lines_out_of_the_report(tmp_path):
    script = (
        "import sys\nprint('the real error line')\n"
        "for i in range(50): sys.stdout.write(f'\\rsteps {i}/50')\nsys.stdout.write('\\n')\nsys.exit(2)\n"
    )
    out = io.StringIO()
    assert run_supervised([PY, "-c", script], None, tmp_path / "log", echo=out) == 2
    report = out.getvalue().split("---- last ")[1]
    assert "the real error line" in report and "steps 49/50" in report and "steps 48/50" not in report


def test_a_child_killed_without_a_word_is_explained_as_the_out_of_memory_killer(tmp_path):
    """Exit 137 and no traceback (the kernel's OOM killer sends SIGKILL): the cause names it and what to lower."""
    cmd = [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    out = io.StringIO()
    assert run_supervised(cmd, None, tmp_path / "log", echo=out) == 137
    text = out.getvalue()
    assert "out-of-memory killer" in text and "train.data_loader_workers=0" in text and "not recognised" not in text


def test_the_oom_kill_count_is_read_where_the_cgroup_has_one():
    from flux_trainer.launch.failure import killed_message, oom_kill_count

    count = oom_kill_count()
    assert count is None or count >= 0
    assert "count went 0 -> 1" in killed_message(0, 1, None) and "was most likely" in killed_message(None, None, None)


SUPERVISOR_GRACEFUL = """
import sys
from pathlib import Path
from flux_trainer.launch.supervise import run_supervised
reason = lambda code: "interrupted at step 3 (SIGINT); resume=auto continues" if code == 130 else None
sys.exit(run_supervised(sys.argv[2:], None, Path(sys.argv[1]), graceful=True, reason=reason))
"""

# A training process with a data-loader-like worker in its group: the worker dies on SIGINT (marker), the trainer
# notes SIGINT and exits 130 once its "step" ends.
CHILD_WITH_WORKER = """
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import signal,sys,time\\n"
    "def die(s, f):\\n    open(sys.argv[1], 'w').write('worker got SIGINT'); sys.exit(1)\\n"
    "signal.signal(signal.SIGINT, die)\\ntime.sleep(30)", sys.argv[1]],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not holding the output open
def stop(signum, frame):
    print("trainer got SIGINT", flush=True)
    time.sleep(0.5)
    alive = worker.poll() is None
    worker.kill()
    sys.exit(130 if alive else 99)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(30)
"""


def test_a_graceful_first_ctrl_c_reaches_the_trainer_alone_and_its_reason_is_said(tmp_path):
    (tmp_path / "supervisor.py").write_text(SUPERVISOR_GRACEFUL)
    (tmp_path / "child.py").write_text(CHILD_WITH_WORKER)
    log, marker = tmp_path / "train.log", tmp_path / "worker"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [PY, str(tmp_path / "supervisor.py"), str(log), PY, str(tmp_path / "child.py"), str(marker)]
    sup = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(log, "ready")
    sup.send_signal(signal.SIGINT)
    assert sup.wait(timeout=20) == 130
    text = log.read_text()
    assert not marker.exists()  # the worker carried on: the step it fed could finish
    assert "trainer got SIGINT" in text and "interrupted at step 3 (SIGINT)" in text
    assert "stopped on request" not in text and "cause:" not in text
