"""Training: optimisers and schedules, train state, micro-batching, pure step builders.

Every step builder returns a pure function

```python
step(params, opt_state, batch, *, frozen=None, key=None, ...) -> (params, opt_state, metrics)
```

compiled as one `eqx.filter_jit` region: `params` is the trainable partition of the
model (or the whole model), `frozen` the rest (combined inside the step), reference
models are explicit keyword arguments and never differentiated, and `metrics` is a dict
of float32 scalars. `TrainState.apply(step, batch, ...)` runs the same step on a
`TrainState`.
"""

from ._accumulate import (
    accumulate_gradients as accumulate_gradients,
    apply_optimizer as apply_optimizer,
    split_micro_batches as split_micro_batches,
    sums_to_means as sums_to_means,
)
from ._optim import (
    learning_rate_from_state as learning_rate_from_state,
    make_optimizer as make_optimizer,
    make_schedule as make_schedule,
)
from ._sft import make_sft_step as make_sft_step
from ._state import (
    TrainState as TrainState,
    init_train_state as init_train_state,
    partition_trainable as partition_trainable,
)
from ._dpo import (
    compute_reference_logps as compute_reference_logps,
    make_dpo_step as make_dpo_step,
    sequence_logps as sequence_logps,
)
from ._grpo import (
    GRPOBatch as GRPOBatch,
    grpo_advantages as grpo_advantages,
    make_grpo_step as make_grpo_step,
)
from ._ppo import (
    PPOBatch as PPOBatch,
    compute_advantages as compute_advantages,
    make_ppo_step as make_ppo_step,
    prepare_ppo_batch as prepare_ppo_batch,
    token_values as token_values,
)
from ._reward import make_reward_step as make_reward_step
