"""The musubi-tuner checkout the tests use, found the way users' runs find it (`musubi_tuner=PATH`,
$FLUX_TRAIN_MUSUBI_TUNER, the cache folder): `MUSUBI` (None where there is none) and `WHY` (why not), and
`need_musubi()`, which skips a test with that reason."""

from __future__ import annotations

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.musubi.checkout import locate

try:
    MUSUBI, WHY = locate(), ""
except ConfigError as exc:  # pragma: no cover - depends on the machine
    MUSUBI, WHY = None, str(exc)


def need_musubi() -> None:
    if MUSUBI is None:
        pytest.skip(f"needs a musubi-tuner checkout: {WHY}")
