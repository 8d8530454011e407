"""Configuration: the typed schema, Hydra composition of the shipped configs, and cross-field checks."""

from lctrain.config.checks import check_job, check_model_job
from lctrain.config.load import CONFIG_DIR, RECIPE_DIR, load_config, to_yaml
from lctrain.config.schema import (
    CheckpointConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "CONFIG_DIR",
    "RECIPE_DIR",
    "CheckpointConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_job",
    "check_model_job",
    "load_config",
    "to_yaml",
]
