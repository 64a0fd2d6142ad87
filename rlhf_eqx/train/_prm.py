r"""Process reward models: training on step labels, and step scores as PPO / GRPO rewards.

A process reward model (PRM; Lightman et al. 2023, "Let's Verify Step by Step") is a
per-token scalar model (the `ValueModel` architecture: `(tokens, mask) -> [T]`) whose
output at the separator ending each reasoning step is the logit of "this step is
correct". `make_prm_step` trains it on a `PRMBatch` (`data.collate_stepwise` builds one
from TRL's stepwise-supervision records) with `rlhf_eqx.losses.process_reward_loss`.

Its scores become rewards in two ways (`process_rewards`):

- **per token, for PPO**: the step score at each step end, 0 elsewhere (`[B, T]`,
  `rlhf_eqx.losses.process_token_rewards`). `prepare_ppo_batch` takes one score per
  sequence; `add_token_rewards` adds per-token rewards to the batch it returns (built
  with `whiten=False`), which is exact because GAE is linear in the rewards;
- **per sequence, for GRPO**: the minimum, last or mean step score
  (`rlhf_eqx.losses.process_sequence_reward`), as `GRPOBatch.rewards`.

On sampled completions the step ends are found with `step_end_mask` (the separator
tokens, and the end of an unterminated last step).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ..data import PPOBatch, PRMBatch
from ..losses import (
    PRM_AGGREGATIONS,
    PRMAggregation,
    aggregate_parts,
    gae,
    process_reward_loss,
    process_sequence_reward,
    process_token_rewards,
    whiten_advantages,
)
from ..ops import masked_sum
from ._accumulate import vmap_model
from ._builder import step_builder
from ._settings import StepOptions, settings_from
from ._state import combine
from ._step import LossFn, Step, make_step
from ._validation import check_aggregation, check_choice, check_number

PRM_SCORES = ("prob", "logit")
"""The values of `process_rewards(..., score=)`: a step's probability of being correct, or
its logit."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PRMSettings:
    """A process reward model (`make_prm_step`; Lightman et al. 2023, TRL `PRMTrainer`):
    the aggregation `mode` of the per-step binary cross-entropy over the step ends of the
    batch (`rlhf_eqx.losses.aggregate_parts`; `"token-mean"`: the mean over every step).
    Validated when built (see `DPOSettings`): one `ValueError` line naming the field."""

    mode: str = "token-mean"

    def __post_init__(self):
        check_aggregation(self.mode, None)


def _step_logits(model, tokens, mask, key):
    out = vmap_model(model, tokens, mask, key)
    if not hasattr(out, "shape") or tuple(out.shape) != tuple(tokens.shape):
        shape = getattr(out, "shape", type(out).__name__)
        raise ValueError(
            f"a process reward model must return one scalar per position: "
            f"{type(model).__name__} returned {shape} for tokens of shape {tokens.shape}; use a "
            "per-token scalar model such as rlhf_eqx.ValueModel"
        )
    return out.astype(jnp.float32)


def prm_loss(settings: PRMSettings | None = None, **shortcuts: Any) -> LossFn:
    r"""The process-reward loss function for `make_step` on a `PRMBatch`: binary
    cross-entropy of the model's logits at the step ends, reduced with `mode`
    (`aggregate_parts`; `"token-mean"`: the mean over every step of the batch), with
    `settings` (a `PRMSettings`, or its fields as keywords)."""
    mode = settings_from(PRMSettings, settings, shortcuts, where="prm_loss").mode

    def loss_fn(params: PyTree, frozen: PyTree, batch: PRMBatch, key: PRNGKeyArray | None):
        model = combine(params, frozen)
        logits = _step_logits(model, batch.tokens, batch.mask, key)
        steps = batch.step_mask & batch.mask
        labels = batch.step_labels.astype(jnp.float32)
        per_token = jax.vmap(process_reward_loss)(logits, steps, labels)
        num, den = aggregate_parts(per_token, steps, mode=mode)
        n = jnp.sum(steps).astype(jnp.float32)
        positive = labels > 0.5
        correct = jnp.where(positive, logits > 0, logits <= 0)
        prob = jax.nn.sigmoid(logits)
        rows = jnp.asarray(steps.shape[0], jnp.float32)
        metrics = {
            "accuracy": (masked_sum(correct.astype(jnp.float32), steps), n),
            "steps/positive": (masked_sum(positive.astype(jnp.float32), steps), n),
            "steps/per_row": (n, rows),
            "score/mean": (masked_sum(prob, steps), n),
        }
        return {"prm": num}, {"prm": den}, metrics

    return loss_fn


@step_builder(PRMSettings)
def make_prm_step(optimizer, settings: PRMSettings, options: StepOptions) -> Step:
    r"""Build the process-reward-model update (Lightman et al. 2023; TRL `PRMTrainer`).

    $$\mathcal L(\phi) = \mathrm{aggregate}_{\rm mode}\Big(-\big[y_t\log\sigma(z_{\phi,t})
    + (1 - y_t)\log\sigma(-z_{\phi,t})\big]\ \text{at the step ends } t\Big)$$

    with $z_{\phi,t}$ the model's scalar output at position $t$ (any `(tokens, mask) ->
    [T]` model, e.g. `ValueModel` or `ValueModel.from_policy(policy, key=...)`; a model
    returning another shape is refused when the step is first traced), via
    `rlhf_eqx.losses.process_reward_loss`.

    **Arguments:** `settings`, a `PRMSettings` (`mode`); `optimizer`, `options` (a
    `StepOptions`) and `**shortcuts` (`mode="seq-mean-token-mean"`, `micro_batches=2`):
    see `step_builder`.

    **Returns:** `step(params, opt_state, batch: PRMBatch, *, frozen=None, key=None)
    -> (params, opt_state, metrics)`. Metrics: `loss`, `accuracy` (steps whose
    verdict $z > 0$ matches the label $y > 0.5$), `steps/positive` (fraction of steps
    labelled correct), `steps/per_row`, `score/mean` (mean $\sigma(z)$ at the steps),
    `grad_norm`, `learning_rate`, `nonfinite`, `empty_batch` (a batch without any step
    has nothing to learn from: the update is skipped, see `make_step`).
    """
    return make_step(
        prm_loss(settings),
        optimizer,
        options,
        batch_type=PRMBatch,
        cache_key=("prm", settings),
    )


def step_end_mask(
    tokens: Int[Array, "*B T"],
    completion_mask: Bool[Array, "*B T"],
    separator_id: int,
    *,
    final_step: bool = True,
    ignore_ids: Sequence[int] = (),
) -> Bool[Array, "*B T"]:
    """The step ends of sampled completions: where a PRM's output is read.

    Every completion position holding `separator_id` (the last token of the separator
    the PRM was trained with, e.g. `data.separator_id(tokenizer, "\\n")`) ends a step.
    With `final_step`, a last step that no separator terminates (content after the last
    separator) ends at the completion's last token (its EOS, or the cut when the
    completion was truncated). Tokens in `ignore_ids` (e.g. the EOS id) are not step
    content: `"step\\n<eos>"` has one step, `"step<eos>"` one step ending at the EOS.

    **Returns:** a boolean mask of the shape of `tokens`.
    """
    T = tokens.shape[-1]
    idx = jnp.arange(T, dtype=jnp.int32).reshape((1,) * (tokens.ndim - 1) + (T,))
    sep = completion_mask & (tokens == separator_id)
    if not final_step:
        return sep
    content = completion_mask & ~sep
    for i in ignore_ids:
        content = content & (tokens != int(i))
    last_sep = jnp.max(jnp.where(sep, idx, -1), axis=-1, keepdims=True)
    tail = jnp.any(content & (idx > last_sep), axis=-1, keepdims=True)
    last = jnp.max(jnp.where(completion_mask, idx, -1), axis=-1, keepdims=True)
    return sep | (tail & (idx == last))


@eqx.filter_jit
def _process_rewards(model, tokens, mask, step_mask, score, aggregation):
    logits = _step_logits(model, tokens, mask, None)
    scores = jax.nn.sigmoid(logits) if score == "prob" else logits
    steps = step_mask & mask
    token_rewards = jax.vmap(process_token_rewards)(scores, steps)
    sequence = jax.vmap(lambda s, m: process_sequence_reward(s, m, aggregation=aggregation))(
        scores, steps
    )
    return token_rewards, sequence


def process_rewards(
    model: PyTree,
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    step_mask: Bool[Array, "B T"],
    *,
    score: Literal["prob", "logit"] = "prob",
    aggregation: PRMAggregation = "min",
) -> tuple[Float[Array, "B T"], Float[Array, " B"]]:
    r"""A PRM's step scores as rewards: per token (PPO) and per sequence (GRPO); jitted.

    The step score is $p_t = \sigma(z_t)$ (`score="prob"`, the probability that the
    step is correct) or the logit $z_t$ (`score="logit"`), read at the `step_mask`
    positions (e.g. `step_end_mask` of a rollout).

    **Returns:** `(token_rewards [B, T], sequence_rewards [B])`: $p_t$ at the step ends
    and 0 elsewhere (`process_token_rewards`, for `add_token_rewards`), and the
    `aggregation` (`"min"`, `"last"` or `"mean"`) of each row's step scores
    (`process_sequence_reward`; 0 for a row without steps), for `GRPOBatch.rewards`.
    """
    check_choice("score", score, PRM_SCORES)
    check_choice("aggregation", aggregation, PRM_AGGREGATIONS)
    return _process_rewards(model, tokens, mask, step_mask, score, aggregation)


@eqx.filter_jit
def _add_token_rewards(batch, token_rewards, gamma, lam, whiten):
    m = batch.completion_mask
    zero = jnp.zeros_like(batch.old_values)
    extra, _ = jax.vmap(lambda r, mi: gae(r, jnp.zeros_like(r), mi, gamma=gamma, lam=lam))(
        token_rewards.astype(jnp.float32), m
    )
    advantages = batch.advantages + extra
    returns = jnp.where(m, batch.returns + extra, zero)
    if whiten:
        advantages = whiten_advantages(advantages, m)
    stats = {"objective/process_reward": jnp.mean(masked_sum(token_rewards, m, axis=-1))}
    return eqx.tree_at(lambda b: (b.advantages, b.returns), batch, (advantages, returns)), stats


def add_token_rewards(
    batch: PPOBatch,
    token_rewards: Float[Array, "B T"],
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
) -> tuple[PPOBatch, dict[str, Float[Array, ""]]]:
    r"""Add per-token rewards (e.g. a PRM's, `process_rewards`) to a PPO batch's advantages.

    GAE is linear in the rewards for fixed values: with $\delta_t = r_t + \gamma V_{t'} -
    V_t$, rewards $r + r'$ give $A(r + r', V) = A(r, V) + A(r', 0)$ and returns $R + A(r',
    0)$. So for `batch = prepare_ppo_batch(..., whiten=False)` (KL-shaped rewards and
    the sequence scores), this returns the batch whose advantages and returns are those
    of the rewards $r_t + r'_t$, whitened over the batch when `whiten` (as
    `prepare_ppo_batch(..., whiten=True)` would). Pass the `gamma` and `lam` given to
    `prepare_ppo_batch`; a batch whose advantages were already whitened gives wrong
    advantages (its returns stay right).

    **Arguments:** `batch` (a `PPOBatch`), `token_rewards` `[B, T]` (read on the
    completion tokens only), `gamma`, `lam`, `whiten`.

    **Returns:** `(batch, stats)`, `stats["objective/process_reward"]` the mean over
    rows of the summed token rewards.
    """
    check_number("gamma", gamma, low=0.0, high=1.0)
    check_number("lam", lam, low=0.0, high=1.0)
    return _add_token_rewards(batch, token_rewards, gamma, lam, bool(whiten))
