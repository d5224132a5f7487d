"""Write the committed schema of musubi-tuner's FLUX.2 / Kontext argument parsers.

musubi-tuner silently ignores unknown keys in its training TOML, so every run checks the keys we emit against this
file. Each script's parser is taken from its own `main()` at its first parse_args (the caching scripts build theirs
inline). Regenerate it from a real checkout whenever the pinned commit changes:

    python scripts/gen_musubi_schema.py --musubi-tuner ~/.cache/flux-trainer/musubi-tuner
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flux_trainer.backend.checkout import checkout_commit
from flux_trainer.backend.parser_schema import describe_parser, parser_of
from flux_trainer.backend.tv_shim import install_torchvision_shim
from flux_trainer.musubi.checkout import argv, import_module
from flux_trainer.musubi.parser_schema import ALL_SCRIPTS, SCHEMA_PATH


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--musubi-tuner", required=True, type=Path, help="checkout to read the parsers from")
    ap.add_argument("--commit", help="the checkout's commit, where it has neither .git nor .flux-train-commit")
    ap.add_argument("--out", type=Path, default=SCHEMA_PATH, help=f"where to write (default {SCHEMA_PATH})")
    ns = ap.parse_args()
    install_torchvision_shim()
    scripts = {}
    for script in ALL_SCRIPTS:
        module = import_module(ns.musubi_tuner, script)
        with argv(f"{script}.py", []):
            scripts[script] = describe_parser(parser_of(module.main))
    schema = {
        "commit": ns.commit or checkout_commit(ns.musubi_tuner),
        "generated_by": "scripts/gen_musubi_schema.py",
        "scripts": scripts,
    }
    ns.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    counts = ", ".join(f"{k} {len(v)}" for k, v in scripts.items())
    print(f"wrote flags of commit {schema['commit']} to {ns.out}: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
