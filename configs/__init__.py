"""rlbus configuration: pydantic models for a whole run, TOML presets, and loading.

    from configs import load_config, dump_toml
    cfg = load_config("smoke", ["trainer.lr=1e-4"])   # preset name or TOML path
    print(dump_toml(cfg))                             # fully resolved, re-loadable

- ``models``: the run config, one pydantic model per TOML section (``RunConfig`` on top)
- ``orchestrator``: the ``[orchestrator]`` section (sampling, envs, algorithms, model
  endpoints, eval, the SFT warm start) and its cross-field rules
- ``loading``: a TOML file or preset plus ``key=value`` overrides -> a validated RunConfig
- ``deprecations``: old (and prime-rl's) config spellings, translated to current ones
  before validation
- ``errors``: ``ConfigError`` and ``ConfigDeprecationWarning``
- ``paths``: where runs live (the data directory) and a run's files (``RunPaths``)
- ``toml_emit``: a tiny TOML writer, so a resolved config can be saved and re-run as is
- ``presets/``: the TOML presets ``load_config`` finds by name

Imports nothing heavy (pydantic and the stdlib only): the CLI and every role import
this before deciding whether they need torch.
"""

from configs.deprecations import translate_deprecated
from configs.errors import ConfigDeprecationWarning, ConfigError
from configs.loading import (
    DEFAULT_PRESET,
    apply_overrides,
    list_presets,
    load_config,
    parse_override,
    parse_value,
    read_raw,
    resolve,
)
from configs.models import (
    RUN_ID_PATTERN,
    BusConfig,
    EnvServerConfig,
    InferenceConfig,
    LossConfig,
    ModelConfig,
    MonitorConfig,
    RunConfig,
    TinyModelConfig,
    TrainerConfig,
    WandbConfig,
)
from configs.orchestrator import (
    POLICY,
    AlgorithmConfig,
    EnvConfig,
    EnvSftConfig,
    EvalConfig,
    EvalEnvConfig,
    EvalSamplingConfig,
    EvalTarget,
    ModelEndpointConfig,
    OrchestratorConfig,
    SamplingConfig,
    TrainConfig,
    WarmupConfig,
    orchestrator_problems,
)
from configs.paths import RunPaths, resolve_data_dir, settle_data_dir
from configs.toml_emit import dump_toml

__all__ = [
    "DEFAULT_PRESET",
    "POLICY",
    "RUN_ID_PATTERN",
    "AlgorithmConfig",
    "BusConfig",
    "ConfigDeprecationWarning",
    "ConfigError",
    "EnvConfig",
    "EnvServerConfig",
    "EnvSftConfig",
    "EvalConfig",
    "EvalEnvConfig",
    "EvalSamplingConfig",
    "EvalTarget",
    "InferenceConfig",
    "LossConfig",
    "ModelConfig",
    "ModelEndpointConfig",
    "MonitorConfig",
    "OrchestratorConfig",
    "RunConfig",
    "RunPaths",
    "SamplingConfig",
    "TinyModelConfig",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
    "WarmupConfig",
    "apply_overrides",
    "dump_toml",
    "list_presets",
    "load_config",
    "orchestrator_problems",
    "parse_override",
    "parse_value",
    "read_raw",
    "resolve",
    "resolve_data_dir",
    "settle_data_dir",
    "translate_deprecated",
]
