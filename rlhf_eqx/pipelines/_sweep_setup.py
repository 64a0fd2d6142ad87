"""What the per-stage sweeps share: each member's train state as its separate run sets
it up, the traced optimiser of the step builders, the steps of one iteration over the
stacked states, and a policy member's evaluation and export."""

from collections.abc import Callable, Sequence

import jax
import numpy as np

import rlhf_eqx as rx

from ._lr_scale import build_optimizer
from ._rl_rollouts import _policy_and_reference
from ._runs import export_policy, final_policy
from ._sweep_grid import Member
from ._sweep_program import (
    hyper_arrays,
    make_program,
    member,
    one_seed_shared,
    stack,
    unstacked_metrics,
)
from ._validation import validate_stage


def member_state(model, c, key: jax.Array, total: int):
    """A member's start as `run_sft` / `run_dpo` / `run_kto` / `run_grpo` make it:
    `k_lora, ctx_key = split(key)`, LoRA adapters per `c.lora` (the reference is the
    model without them), the optimiser of `c.optim` over `total` updates.

    **Returns:** `(train state, reference, ctx_key)`."""
    k_lora, ctx_key = jax.random.split(key)
    pol, spec, reference = _policy_and_reference(model, c.lora, k_lora)
    state = rx.train.init_train_state(pol, build_optimizer(c.optim, total), filter_spec=spec)
    return state, reference, ctx_key


def member_states(
    members: Sequence[Member], section: str, start: Callable[[Member], tuple], total: int
):
    """`member_state` of every member (its stage section `section` validated first),
    `start(mem) -> (model, key)` its model and run key.

    **Returns:** `(states stacked, [reference], [ctx_key])`."""
    out = []
    for mem in members:
        c = getattr(mem.cfg, section)
        validate_stage(section, c)
        model, key = start(mem)
        out.append(member_state(model, c, key, total))
    states, references, keys = zip(*out)
    return stack(states), list(references), list(keys)


def program_of(members: Sequence[Member], states, build_step: Callable[[dict], Callable]):
    """`(program, hyper)`: the sweep's update (`make_program`, the frozen part shared when
    one seed's members share it) and the members' traced grid values."""
    program = make_program(build_step, seeds=one_seed_shared(states, [m.seed for m in members]))
    return program, hyper_arrays([dict(m.point) for m in members])


def take_steps(program, states, hyper, keys, batches, active: np.ndarray, records, finite):
    """One update of the members where `active` (`program` of `make_program`): each one's
    metrics appended to `records[m]`, `finite[m]` cleared where it diverged.

    **Returns:** `(states, active)`, `active` without the members that diverged."""
    states, metrics, ok = program(states, hyper, keys, batches, active)
    ok = np.asarray(ok)
    for m in map(int, np.flatnonzero(active)):
        records[m].append(unstacked_metrics(metrics, m))
        if not ok[m]:
            finite[m] = False
    return states, active & ok


def policy_outputs(
    stage: str,
    evaluate_policy: Callable[[int, object], dict],
    tokenizer_file=None,
    *,
    policy_of: Callable[[object, int], object] | None = None,
    finish: Callable = final_policy,
):
    """`(evaluate, export)` of a `SweepRun` of a policy stage: member `m`'s adapted model
    `policy_of(states, m)`, its final policy `finish(model)` (adapters merged),
    evaluated by `evaluate_policy(m, policy)` and exported as `<stage>/hf/` (`export_policy`);
    `policy_of` defaults to the model of stacked train states."""
    policy_of = policy_of or model_of

    def evaluate(states, m: int) -> dict:
        return evaluate_policy(m, finish(policy_of(states, m)))

    def export(states, m: int, directory: str) -> None:
        model = policy_of(states, m)
        export_policy(finish(model), directory, stage, adapted=model, tokenizer_file=tokenizer_file)

    return evaluate, export


def model_of(states, m: int):
    """Member `m`'s model of stacked train states."""
    return member(states, m).model
