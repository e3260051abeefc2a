"""The configuration: `schema` (one dataclass per section, every default), `compose` (the schema and
recipes in Hydra's ConfigStore; a composed config made typed), `checks` (semantic validation,
devices first) and `resources` (what a run needs, and the GPUs this machine has, without torch).
Imports nothing of rlray outside this package; Hydra is imported only by `compose.register`.
"""

from rlray.config.checks import backend, engine_workers, validate
from rlray.config.colocation import Colocation, weight_backend
from rlray.config.compose import RECIPES_DIR, recipe_names, register, schema_node, to_config
from rlray.config.schema import (
    AlgoConfig,
    AsyncConfig,
    CheckpointConfig,
    ClusterConfig,
    Config,
    ConfigError,
    EnvConfig,
    EnvSpec,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TeacherConfig,
    TrainerConfig,
    WeightSyncConfig,
)

__all__ = [
    "RECIPES_DIR",
    "AlgoConfig",
    "AsyncConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Colocation",
    "Config",
    "ConfigError",
    "EnvConfig",
    "EnvSpec",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RLConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "TeacherConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "backend",
    "engine_workers",
    "recipe_names",
    "register",
    "schema_node",
    "to_config",
    "validate",
    "weight_backend",
]
