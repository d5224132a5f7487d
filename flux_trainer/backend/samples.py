"""The sample prompts file both trainers read: one prompt per line with `--w/--h/--s/--g/--d` options, sd-scripts'
format, which musubi-tuner's `line_to_prompt_dict` reads the same way (width, height, steps, guidance, seed); on
Kontext each line also names the reference image the sample edits (`--ci`, musubi-tuner's control image)."""

from __future__ import annotations

from typing import Any

SAMPLE_FILE = "sample_prompts.txt"  # in the run dir, written when `sample.prompts` is not empty


def prompts_text(cfg: Any) -> str:
    s = cfg.sample
    references = list(s.get("references") or [])
    lines = []
    for i, prompt in enumerate(s.prompts):
        text = " ".join(str(prompt).split())  # one line per prompt: newlines would split it
        line = f"{text} --w {s.width} --h {s.height} --s {s.steps} --g {s.guidance} --d {s.seed}"
        if references:  # one for every prompt, or one each (config.validate checks which)
            line += f" --ci {references[i] if len(references) > 1 else references[0]}"
        lines.append(line)
    return "\n".join(lines) + "\n"
