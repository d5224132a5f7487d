"""Quiet by default: the training child's output goes to train.log; the terminal gets the child's marked messages and
one progress line (flux_trainer.metrics.progress), carried on a pipe of their own."""

from __future__ import annotations

import io
import sys

from flux_trainer.launch.supervise import run_supervised
from flux_trainer.metrics import progress as pg


def records(view: pg.ProgressView, n: int, total: int) -> None:
    for step in range(1, n + 1):
        view.handle(pg.PROGRESS + f'{{"step": {step}, "total": {total}, "loss": 0.5, "step_s": 2.0, "peak_gib": 3.5}}')


def test_off_a_terminal_the_progress_is_a_line_every_tenth_and_the_last():
    out = io.StringIO()
    view = pg.ProgressView(echo=out, tty=False)
    records(view, 100, 100)
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[0].startswith("step 1/100") and lines[-1].startswith("step 100/100")
    assert "\r" not in out.getvalue()
    assert "loss 0.5000" in lines[-1] and "2.00 s/step" in lines[-1] and "peak 3.5 GiB" in lines[-1]
    assert view.summary() == "100 steps, 2.00 s/step, peak 3.5 GiB"


def test_on_a_terminal_the_line_is_redrawn_in_place_and_ended_before_a_message():
    out = io.StringIO()
    view = pg.ProgressView(echo=out, tty=True)
    view.handle(pg.PROGRESS + '{"phase": "loading the model"}')
    records(view, 3, 10)
    view.handle(pg.SAY + "resumed at step 7")
    text = out.getvalue()
    assert text.count("\r\x1b[2K") == 4 and "preparing: loading the model" in text
    assert "14 s left" in text  # 2.00 s/step x 7 steps
    assert text.endswith(
        "step 3/10  loss 0.5000  2.00 s/step  14 s left  peak 3.5 GiB\nflux-train: resumed at step 7\n"
    )


def test_a_resumed_run_says_which_steps_it_trained():
    view = pg.ProgressView(echo=None)
    for step in (7, 8, 9):
        view.handle(pg.PROGRESS + f'{{"step": {step}, "total": 9}}')
    assert view.summary() == "steps 7-9"


def test_with_verbose_no_progress_line_is_drawn_but_messages_are_shown():
    out = io.StringIO()
    view = pg.ProgressView(echo=out, draw=False)
    records(view, 5, 5)
    view.handle(pg.SAY + "hello")
    assert out.getvalue() == "flux-train: hello\n"


CHILD = """
import sys
from flux_trainer.metrics import progress
print("sd-scripts says a lot" * 3, flush=True)
sys.stderr.write("\\rsteps:  50%|#####     | 1/2")  # a progress bar without a line end
sys.stderr.flush()
progress.progress(phase="loading the model")
progress.say("resumed at step 1")
for step in (1, 2):
    progress.progress(step=step, total=2, loss=0.25, step_s=1.5)
print("more of sd-scripts", flush=True)
"""


def test_the_terminal_gets_the_marked_lines_and_the_log_everything_else(tmp_path):
    out = io.StringIO()
    view = pg.ProgressView(echo=out, tty=False)
    code = run_supervised([sys.executable, "-c", CHILD], None, tmp_path / "train.log", echo=out, view=view, quiet=True)
    assert code == 0
    shown = out.getvalue().splitlines()
    assert shown == [
        "preparing: loading the model",
        "flux-train: resumed at step 1",
        "step 1/2  loss 0.2500  1.50 s/step  2 s left",
        "step 2/2  loss 0.2500  1.50 s/step",
    ]
    log = (tmp_path / "train.log").read_text()
    assert "sd-scripts says a lot" in log and "more of sd-scripts" in log and "steps:  50%" in log
    assert "flux-train: resumed at step 1" in log and pg.PROGRESS not in log  # messages kept, progress not


def test_a_failed_quiet_run_still_shows_the_logs_end_and_the_cause(tmp_path):
    out = io.StringIO()
    view = pg.ProgressView(echo=out)
    child = "import sys; print('Traceback (most recent call last):'); print('CUDA out of memory'); sys.exit(1)"
    code = run_supervised([sys.executable, "-c", child], None, tmp_path / "log", echo=out, view=view, quiet=True)
    assert code == 1
    text = out.getvalue()
    assert "CUDA out of memory" in text and "cause: the GPU ran out of memory" in text
