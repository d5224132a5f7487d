"""Write the committed schema of sd-scripts' FLUX LoRA argument parser.

sd-scripts silently ignores unknown keys in its training TOML, so every run checks the keys we emit
against this file. Regenerate it from a real checkout whenever the pinned commit changes:

    python scripts/gen_sdscripts_schema.py --sd-scripts ~/.cache/flux-trainer/sd-scripts
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flux_trainer.sdscripts.checkout import checkout_commit, import_sd_scripts
from flux_trainer.sdscripts.parser_schema import SCHEMA_PATH, describe_parser


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sd-scripts", required=True, type=Path, help="sd-scripts checkout to read the parser from")
    ap.add_argument("--out", type=Path, default=SCHEMA_PATH, help=f"where to write (default {SCHEMA_PATH})")
    ns = ap.parse_args()
    modules = import_sd_scripts(ns.sd_scripts)
    schema = {
        "commit": checkout_commit(ns.sd_scripts),
        "generated_by": "scripts/gen_sdscripts_schema.py",
        "flags": describe_parser(modules.flux_train_network.setup_parser()),
    }
    ns.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(schema['flags'])} flags from commit {schema['commit']} to {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
