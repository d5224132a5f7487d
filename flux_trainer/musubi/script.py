"""One of musubi-tuner's scripts, run as its own command line would run it, from the pinned checkout.

`python -m flux_trainer.musubi.script [--random-model DIT] CHECKOUT MODULE [ARGS...]` puts the checkout's `src` first
on sys.path, gives the process the few torchvision names musubi-tuner imports where no torchvision matches the
installed PyTorch (flux_trainer.backend.tv_shim), teaches musubi-tuner's loaders a random preset's shapes when
`--random-model` names its DiT file (flux_trainer.musubi.random_model), applies `flux-train bench --vram-cap` where
it is set, and calls `musubi_tuner.MODULE.main()` with ARGS as its sys.argv. The musubi runner starts the caching
scripts this way, each in a process of its own so their models leave memory before training; `flux-train bench
--baseline` starts plain musubi-tuner's training script this way (flux_trainer.musubi.baseline).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from flux_trainer.backend.tv_shim import install_torchvision_shim
    from flux_trainer.musubi.checkout import argv as script_argv
    from flux_trainer.musubi.checkout import import_module
    from flux_trainer.sdscripts.runner import VRAM_CAP_ENV, apply_vram_cap

    args = list(sys.argv[1:] if argv is None else argv)
    random_dit = None
    if args[:1] == ["--random-model"] and len(args) > 1:
        random_dit, args = args[1], args[2:]
    if len(args) < 2:
        print(
            "usage: python -m flux_trainer.musubi.script [--random-model DIT] CHECKOUT MODULE [ARGS...]",
            file=sys.stderr,
        )
        return 2
    checkout, name, rest = args[0], args[1], args[2:]
    install_torchvision_shim()
    apply_vram_cap(os.environ.get(VRAM_CAP_ENV))  # `flux-train bench --vram-cap`: our caching steps (never plain's)
    module = import_module(checkout, name)
    if random_dit:
        from flux_trainer.musubi.random_model import install_random_model

        install_random_model(random_dit)
    with script_argv(f"{name}.py", rest):
        result = module.main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
