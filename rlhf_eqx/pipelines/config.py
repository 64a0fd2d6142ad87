"""The configuration's machinery beyond building and reading a `PipelineConfig`: the
registry's queries (`stages`, `get_stage`, ...), the shared fields of batch and rollout
stages, the built-in task's stage settings, a command line's configuration
(`command_line_config`), what a command's `--help` and a run print (`config_help`,
`read_fields`), and the checks of single sections (`validate_stage`,
`validate_ops`, `validate_judge`), the whole configuration's check (`validate_config`)
and its dictionary form (`config_to_dict`, `config_from_dict`). `rlhf_eqx.pipelines`
itself has `PipelineConfig`, `load_config` and `apply_overrides`."""

from ._config import (
    REWARD_SOURCES as REWARD_SOURCES,
    BatchStageConfig as BatchStageConfig,
    RolloutStageConfig as RolloutStageConfig,
)
from ._config_help import config_help as config_help, help_sections as help_sections
from ._config_io import (
    SHARED_SECTIONS as SHARED_SECTIONS,
    command_line_config as command_line_config,
    config_from_dict as config_from_dict,
    config_to_dict as config_to_dict,
    read_fields as read_fields,
)
from ._data_runs import data_stages as data_stages
from ._pipeline_config import (
    TASK_STAGE_SETTINGS as TASK_STAGE_SETTINGS,
    task_section as task_section,
)
from ._registry import (
    find_stage as find_stage,
    get_stage as get_stage,
    stage_names as stage_names,
    stages as stages,
    unregister_stage as unregister_stage,
)
from ._validation import (
    DATA_FORMATS as DATA_FORMATS,
    validate_config as validate_config,
    validate_judge as validate_judge,
    validate_ops as validate_ops,
    validate_stage as validate_stage,
)
