"""The sample prompts file both trainers read: one prompt per line with `--w/--h/--s/--g/--d` options, sd-scripts'
format, which musubi-tuner's `line_to_prompt_dict` reads the same way (width, height, steps, guidance, seed)."""

from __future__ import annotations

from typing import Any

SAMPLE_FILE = "sample_prompts.txt"  # in the run dir, written when `sample.prompts` is not empty


def prompts_text(cfg: Any) -> str:
    s = cfg.sample
    lines = []
    for prompt in s.prompts:
        text = " ".join(str(prompt).split())  # one line per prompt: newlines would split it
        lines.append(f"{text} --w {s.width} --h {s.height} --s {s.steps} --g {s.guidance} --d {s.seed}")
    return "\n".join(lines) + "\n"
