"""Configuration: the typed schema, Hydra composition of ``configs/`` + ``recipes/``, and cross-field checks."""

from lctrain.config.load import CONFIG_DIR, check_job, check_model_job, load_config, to_yaml
from lctrain.config.schema import (
    CheckpointConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "CONFIG_DIR",
    "CheckpointConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_job",
    "check_model_job",
    "load_config",
    "to_yaml",
]
