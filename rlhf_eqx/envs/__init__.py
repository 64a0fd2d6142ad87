"""Multi-turn environments and rollouts.

A policy plays several turns against an environment — a jittable `Environment` inside
one compiled rollout (`rollout_multiturn`), or a Python `HostEnvironment` /
`TextEnvironment` (tools, interpreters, anything) between compiled policy turns
(`rollout_multiturn_host`). Both return a `Trajectory` whose `loss_mask` marks the
policy's own tokens only, ready for the GRPO / PPO steps (`completion_mask=loss_mask`,
`old_logp=logprobs`). `check_environment` runs a rollout's checks of a jittable
environment before anything is compiled; `check_trajectory` the checks of its values
that a rollout inside `jit` / `vmap` cannot run.

The animal task's words (`ANIMALS`, with `animal_word_forms`) are shared by its
follow-up environment (`AnimalFollowUpEnv`) and the built-in task's scorer
(`rlhf_eqx.pipelines.animal_score`).
"""

from ._animal import (
    AnimalFollowUpEnv as AnimalFollowUpEnv,
    animal_followup_score as animal_followup_score,
)
from ._animal_words import ANIMALS as ANIMALS, animal_word_forms as animal_word_forms
from ._calculator import calculator as calculator
from ._compiled_rollout import (
    check_environment as check_environment,
    check_trajectory as check_trajectory,
    rollout_multiturn as rollout_multiturn,
)
from ._environment import (
    Environment as Environment,
    HostEnvironment as HostEnvironment,
    TextEnvironment as TextEnvironment,
)
from ._host_rollout import rollout_multiturn_host as rollout_multiturn_host
from ._tools import (
    ToolCall as ToolCall,
    ToolEnvironment as ToolEnvironment,
    call_tool as call_tool,
    parse_tool_calls as parse_tool_calls,
)
from ._trajectory import Trajectory as Trajectory
