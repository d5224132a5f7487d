"""The typed run config: schema, composition and validation. Imports only stdlib, omegaconf and hydra."""

from flux_trainer.config.compose import compose_run, hydra_overrides, register
from flux_trainer.config.errors import ConfigError
from flux_trainer.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "compose_run", "hydra_overrides", "register"]
