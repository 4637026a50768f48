"""Job configuration: one dataclass per TOML section, CLI overrides, validation and --help.

Precedence is CLI > TOML > dataclass defaults. Every error is a `ConfigError` with a one-line
message naming the field and what is allowed; `train.py` turns it into exit code 2.

sections.py is the schema (hardware_sections.py its sections for how a run maps onto hardware:
parallelism, activation checkpointing, compile, mixed precision, the dry run, communication, fault
tolerance; option.py the field helper they all use), bounds.py what one field allows beyond its
type (declared on the field, shown by --help), fields.py what a field allows and how a value is
typed and checked, loading.py the resolution order, validation.py the rules across fields,
presentation.py --help and the TOML dump.
"""

from torchtitan_amp.config.fields import choices_of, field_choices
from torchtitan_amp.config.hardware_sections import (
    ActivationCheckpointConfig,
    CommConfig,
    CompileConfig,
    DryRunConfig,
    FaultToleranceConfig,
    MixedPrecisionConfig,
    ParallelismConfig,
)
from torchtitan_amp.config.loading import apply_toml, load_config, load_toml, parse_cli
from torchtitan_amp.config.option import BoolOrAuto
from torchtitan_amp.config.presentation import help_text, to_toml
from torchtitan_amp.config.sections import (
    CheckpointConfig,
    DebugConfig,
    JobConfig,
    JobSectionConfig,
    LoraConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
    section_names,
)
from torchtitan_amp.config.validation import validate
from torchtitan_amp.core.errors import ConfigError

__all__ = [
    "ActivationCheckpointConfig",
    "BoolOrAuto",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "ConfigError",
    "DebugConfig",
    "LoraConfig",
    "DryRunConfig",
    "FaultToleranceConfig",
    "JobConfig",
    "JobSectionConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilingConfig",
    "TrainingConfig",
    "ValidationConfig",
    "apply_toml",
    "choices_of",
    "field_choices",
    "help_text",
    "load_config",
    "load_toml",
    "parse_cli",
    "section_names",
    "to_toml",
    "validate",
]
