"""GRPO (Shao et al. 2024), the `grpo` stage: its settings (`GRPOConfig`), its run
(group-relative advantages on sampled groups, with verifiable rewards or any reward
source; rollouts from a stale policy with importance correction, DAPO's dynamic sampling
and overlong shaping), the stage on the built-in task (from SFT, rewards from
`grpo.reward_source`) and on prompts with reference answers (exact match), and its
registration."""

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data

from ..train import GRPOSettings
from ._config import _SET_BY_SAMPLING, RolloutStageConfig, SamplingConfig, _optim
from ._data_prep import (
    chat_records,
    is_preference_file,
    log_left_out,
    log_skipped,
    prompt_tokens,
    record_numbers,
    split_records,
    trained_policy,
)
from ._field_checks import _at_least, _check_options, _choice, _divides, _fail
from ._lr_scale import build_optimizer
from ._monitor import model_flops
from ._partial_rollouts import PartialRollouts, check_partial_rollouts
from ._placement import (
    PLACEMENTS,
    SplitPlacement,
    check_device_setting,
    parse_mesh,
    split_devices,
)
from ._registry import Outcome, Stage, StageEnv, register_stage
from ._reward_sources import (
    RewardSource,
    as_reward_source,
    check_reward_functions,
    heldout_reward_summary,
    prompt_file_reward,
    scored_needs,
    scored_on_task,
)
from ._rl_rollouts import _compare, _dispatch_sample, _policy_and_reference
from ._rollout import (
    RewardFunction,
    Rollout,
    finish_rollout,
    group_signal,
    no_signal_message,
)
from ._runs import RunContext, RunResult, final_policy, rl_step_settings, run_loop
from ._sampled_eval import sampled_comparison
from ._validation import validate_stage

MAX_STALENESS: int = 8
"""The largest `grpo.staleness`: each stale policy's trainable parameters are held in
memory and written with every checkpoint (asynchronous RL systems keep 1 to a few)."""


@dataclasses.dataclass(frozen=True)
class GRPOConfig(RolloutStageConfig, GRPOSettings):
    """GRPO (Shao et al. 2024) with the task's verifiable reward: `group_size` samples per
    prompt, group-normalised advantages, k3 KL to the reference with weight `beta`
    (TRL's default 0.0: no KL term). The step's settings are
    `rlhf_eqx.train.GRPOSettings` (its `temperature` is `sampling.temperature`; with
    `mode="seq-mean-token-sum-norm"` its `constant` is by default
    `sampling.max_new_tokens`, TRL's `dr_grpo`):
    `policy_loss` selects the token objective of `make_grpo_step`: `grpo` (the PPO-clip
    surrogate), or after DAPO `cispo`, `gmpo`, `sapo`, `clip_cov`, `kl_cov`,
    `high_entropy` (each with the step's published defaults; docs/objectives.md).

    Rollouts:

    - `staleness`: rollout `r` is sampled by the policy of `staleness` updates before
      (one-step off-policy with `1`: the next rollout need not wait for the update;
      0: synchronous); at most `MAX_STALENESS` (8) and below `rollouts` (a larger one
      samples every rollout from the initial policy). The sampler's log-probabilities
      are kept as the behaviour policy's, `old_logp` is the trained policy's own, and
      `rollout_correction` (e.g. `--set grpo.rollout_correction.mode=truncate`, a
      `rlhf_eqx.losses.RolloutCorrection`: truncated or masked importance weights at
      token, sequence or geometric level, veRL's `rollout_is`) reweights the tokens;
      the `rollout_corr/*` metrics measure the mismatch.
    - `overlap` (with `staleness >= 1`; on by default): rollout `r + 1` (whose behaviour
      policy is known before rollout `r`'s update) is sampled before that update and
      decoded and scored by a worker thread while it runs, so the host's decoding and
      reward functions (a sandbox, a verifier service, a judge behind an API) overlap the
      update. The run's numbers do not change (the next rollout depends only on the
      stale parameters and its key); two rollouts are held at once. Reward functions
      then run in that thread, not the main one (a reward that needs the main thread,
      e.g. a `signal.alarm` timeout, needs `overlap=false`).
    - `sampler_device`: the local device that samples rollouts (`jax.local_devices()`
      index; -1, the default: the training device). With `overlap`, the next rollout is
      then sampled on its own device while the update runs on the other (the split of
      asynchronous RL systems between inference and training devices); the behaviour
      parameters are copied to it for each rollout, the frozen weights once. (A
      one-device case of `placement=split`, kept for one device of a process.)
    - `placement`: `colocated` (the default: the sampler runs where the policy trains)
      or `split`: the trainer and the sampler on disjoint meshes of `jax.devices()`,
      the trainer on the first `trainer_devices`, the sampler on the next
      `sampler_devices` (each a count, or a fraction in (0, 1) of the devices; their
      sum at most the devices), laid out as `trainer_mesh` and `sampler_mesh`
      (comma-separated `axis:size` with axes `data`, `fsdp` (data parallel with the
      parameters and optimiser state split over it) and `model` (tensor parallel),
      e.g. `trainer_mesh=fsdp:4`, `sampler_mesh=data:4`; empty: `data:<devices>`).
      After each update the behaviour policy moves to the sampler's layout by one
      resharding `jax.device_put` (only the LoRA adapters when the base is frozen: the
      base is placed on the sampler once), timed as `rollout/weight_sync_s` (bytes:
      `rollout/weight_sync_bytes`); the sampler splits the prompts over its `data`
      axis. The numbers are the colocated run's (up to float reassociation under FSDP).
      In a multi-process run (`jax.distributed`) each mesh spans every process: the
      trainer takes the first `trainer_devices / P` local devices of each of the `P`
      processes, the sampler the next `sampler_devices / P` (counts that do not divide
      by `P` are refused naming the field); the weights move through the hosts (gathered
      from the trainer's devices, placed on the sampler's), the sampled rows are gathered
      to every host for decoding and rewards, and a rollout is sampled before the update
      rather than during it (every program from one thread, in one order on every
      process); `partial_rollouts` is refused there.
      With `staleness = k >= 1` and `overlap`, the sampler runs ahead on its mesh while
      the trainer updates: up to `k` rollouts queued (rollout `r + j` samples with the
      policy of update `r + j - k`, known before update `r` for `j <= k`), consumed in
      order (`rollout/queued`); the numbers are those of the run without overlap, and a
      resumed run samples the queued rollouts again from the checkpoint's stale
      policies. `sampler_device` and `placement=split` exclude each other.
    - `partial_rollouts` (a segment length `S` in tokens; 0, the default: off; needs
      `staleness >= 1`, `0 < S < sampling.max_new_tokens` and no `dynamic_sampling`):
      partial rollouts, AReaL's interruptible generation (Fu et al. 2025, "AReaL: a
      large-scale asynchronous reinforcement learning system for language reasoning") and
      veRL's fully asynchronous mode. Rollout `q` samples its first `S` tokens per row with
      the policy of update `q - staleness`; each newer policy known before the rollout is
      consumed (updates `q - staleness + 1`, ..., `q`) continues the rows that have not
      stopped for `S` more tokens (the last up to `max_new_tokens`) after a fresh prefill
      of prompt + tokens so far with its weights (AReaL recomputes the KV cache). The
      interruption points are token counts, not wall time: a run is reproducible and a
      resumed run samples its rollouts again from the checkpoint's stale policies. Each
      token keeps the log-probability of the policy that sampled it as its behaviour
      log-prob and its version in `Rollout.policy_version`; the loss is decoupled PPO
      (Hilton et al. 2022, as AReaL uses it): `old_logp`, the proximal policy of the
      clip, is the trained policy's own, and `rollout_correction` weights each token by
      `pi_old / mu` with `mu` the token's own behaviour policy (veRL's `rollout_is`,
      truncated or masked). Logged: `rollout/partial_segments` (segments that sampled
      rows), `rollout/version_lag` (mean updates between a token's policy and the
      trained one), `rollout/tokens_lag_<d>`. With `placement=split` the sampler runs
      ahead and continues the queued rollouts during the updates; the last segment (by
      the policy of update `q`) runs when rollout `q` is consumed.
    - `dynamic_sampling`: DAPO's dynamic sampling (Yu et al. 2025) — groups whose
      rewards all agree are dropped and the batch refilled with fresh groups, at most
      this many samplings per rollout (0: off, >= 0); what is still missing is filled
      with dropped groups (zero advantage), so every step has one shape.
    - `overlong_buffer`: DAPO's soft overlong punishment (TRL
      `soft_overlong_punishment`): a completion longer than `max_new_tokens -
      overlong_buffer` tokens loses up to 1 reward linearly (0: off; at most
      `sampling.max_new_tokens`).

    TRL `GRPOConfig` names: `num_generations` is `group_size`, `epsilon` /
    `epsilon_high` `clip_eps` / `clip_eps_high`, `scale_rewards` `scale`, `loss_type`
    `mode` (`grpo`: `seq-mean-token-mean`, `bnpo` / `dapo`: `token-mean`, `dr_grpo`:
    `seq-mean-token-sum-norm`), `num_iterations` `epochs`, `importance_sampling_level`
    `importance`; `delta`, `beta`, `mask_truncated_completions` and `reward_weights` keep
    their names; `max_grad_norm` is `optim.max_grad_norm`, `max_prompt_length` and
    `max_completion_length` `sampling.prompt_length` and `sampling.max_new_tokens`,
    `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` the `sampling`
    section's (the rollouts' filters; the log-probabilities are the tempered policy's).

    KL: `kl_target` (the KL guard) compares `rollout/kl`, the per-token k1 estimate
    (log pi_old - log pi_ref, averaged over the completion tokens) of the rollout's
    sampling policy, measured before the update (with `staleness` that policy is
    `staleness` updates behind the trained one); the steps' `kl` is the k3 estimate of
    the loss's KL term under the policy being trained (TRL's `kl` metric), logged with
    any `beta`."""

    temperature: float = dataclasses.field(
        default=SamplingConfig.temperature, metadata=_SET_BY_SAMPLING
    )
    prompts_per_rollout: int = 8
    group_size: int = 8
    staleness: int = 0
    overlap: bool = True
    sampler_device: int = -1
    placement: str = "colocated"
    trainer_devices: float = 0.5
    sampler_devices: float = 0.5
    trainer_mesh: str = ""
    sampler_mesh: str = ""
    dynamic_sampling: int = 0
    overlong_buffer: int = 0
    partial_rollouts: int = 0

    def check(self, name: str, *, device_count: int = 1) -> None:
        """GRPO's own rules: groups of two or more, rows that divide the devices, the
        staleness below the rollouts and `MAX_STALENESS`, a local sampler device, DAPO's
        counts >= 0, reward functions that import, one finite weight each, scored with
        `reward_source=task` (`check_reward_functions`)."""
        check_reward_functions(name, self)
        if self.group_size < 2:
            _fail(f"{name}.group_size", self.group_size, "must be >= 2")
        _divides(
            f"{name}.prompts_per_rollout", self.prompts_per_rollout * self.group_size, device_count
        )
        _check_options(name, self, self.prompts_per_rollout)
        _at_least(f"{name}.staleness", self.staleness, 0)
        if self.staleness and self.staleness >= self.rollouts:
            _fail(
                f"{name}.staleness",
                self.staleness,
                f"must be < {name}.rollouts={self.rollouts} (rollout r samples from the policy of "
                f"update r - staleness: with {self.staleness}, every rollout would come from the "
                "initial policy)",
            )
        if self.staleness > MAX_STALENESS:
            _fail(
                f"{name}.staleness",
                self.staleness,
                f"must be <= {MAX_STALENESS} (each stale policy's trainable parameters are held "
                "in memory and in every checkpoint)",
            )
        if not isinstance(self.overlap, bool):
            _fail(f"{name}.overlap", self.overlap, "must be true or false")
        _at_least(f"{name}.sampler_device", self.sampler_device, -1)
        local = jax.local_devices()
        if self.sampler_device >= len(local):
            _fail(
                f"{name}.sampler_device",
                self.sampler_device,
                f"this process has {len(local)} local device(s) ({local[0].platform}); on CPU, "
                "XLA_FLAGS=--xla_force_host_platform_device_count=2 makes two",
            )
        _at_least(f"{name}.dynamic_sampling", self.dynamic_sampling, 0)
        _at_least(f"{name}.overlong_buffer", self.overlong_buffer, 0)
        _at_least(f"{name}.partial_rollouts", self.partial_rollouts, 0)
        if self.partial_rollouts and (self.staleness < 1 or self.dynamic_sampling):
            _fail(
                f"{name}.partial_rollouts",
                self.partial_rollouts,
                f"needs {name}.staleness >= 1 (got {self.staleness}) and "
                f"{name}.dynamic_sampling=0 (got {self.dynamic_sampling}): rollouts run ahead "
                "by a stale policy are continued by the newer ones",
            )
        _choice(f"{name}.placement", self.placement, PLACEMENTS)
        for field in ("trainer_devices", "sampler_devices"):
            check_device_setting(f"{name}.{field}", getattr(self, field))
        for field in ("trainer_mesh", "sampler_mesh"):
            parse_mesh(f"{name}.{field}", getattr(self, field))
        if self.placement == "split":
            if self.sampler_device != -1:
                _fail(
                    f"{name}.sampler_device",
                    self.sampler_device,
                    f"must stay -1 with {name}.placement=split (the sampler's devices are "
                    f"{name}.sampler_devices)",
                )
            split_devices(name, self, jax.devices())
        else:
            for field in ("trainer_mesh", "sampler_mesh"):
                if getattr(self, field):
                    _fail(
                        f"{name}.{field}",
                        getattr(self, field),
                        f"must be empty unless {name}.placement=split",
                    )


def check_overlong_buffer(name: str, buffer: int, max_new_tokens: int) -> None:
    """`buffer` (the field `name`, DAPO's soft overlong punishment) is 0 (off) or at most
    `sampling.max_new_tokens`, the length its ramp ends at; `ConfigError` naming the field
    otherwise."""
    if buffer > max_new_tokens:
        _fail(
            name,
            buffer,
            f"must be 0 (off) or at most sampling.max_new_tokens={max_new_tokens} (the "
            "punishment ramps over the last overlong_buffer tokens of the completion budget)",
        )


def _check_run(cfg, run) -> None:
    """The GRPO rules with the sampling settings: `grpo.partial_rollouts` and
    `grpo.overlong_buffer` within `sampling.max_new_tokens`."""
    n = cfg.sampling.max_new_tokens
    check_partial_rollouts("grpo.partial_rollouts", cfg.grpo.partial_rollouts, n)
    check_overlong_buffer("grpo.overlong_buffer", cfg.grpo.overlong_buffer, n)


class OffPolicyState(eqx.Module):
    """A GRPO run's state with `staleness > 0`: the `TrainState` and the trainable
    parameters of the last `staleness` policies before it, oldest first (the behaviour
    policy samples with `behind[0]`); checkpointed together, so a resumed run samples
    with the same stale policies."""

    train: rx.train.TrainState
    behind: tuple


@eqx.filter_jit
def _policy_logps(model, tokens, mask, temperature):
    return jax.vmap(lambda t, m: rx.token_logprobs(model, t, m, temperature=temperature))(
        tokens, mask
    )


def _concat_rollouts(rolls: Sequence[Rollout]) -> Rollout:
    cat = lambda *xs: jnp.concatenate(xs, axis=0)  # noqa: E731
    first = rolls[0]
    return dataclasses.replace(
        first,
        **{f: cat(*(getattr(r, f) for r in rolls)) for f in _ROW_ARRAYS},
        prompts=sum((r.prompts for r in rolls), ()),
        texts=sum((r.texts for r in rolls), ()),
    )


_ROW_ARRAYS = ("tokens", "mask", "completion_mask", "logprobs", "truncated")


def _take_groups(roll: Rollout, groups: np.ndarray, G: int) -> Rollout:
    rows = (np.asarray(groups)[:, None] * G + np.arange(G)[None, :]).reshape(-1)
    return dataclasses.replace(
        roll,
        **{f: getattr(roll, f)[rows] for f in _ROW_ARRAYS},
        prompts=tuple(roll.prompts[i] for i in rows),
        texts=tuple(roll.texts[i] for i in rows),
    )


def _dynamic_groups(rewards: list[np.ndarray], n: int, G: int) -> tuple[np.ndarray, int]:
    """Group indices (into the concatenated samplings) of a full batch: the informative
    groups first, in sampling order, then the first sampling's others to fill up."""
    all_rewards = np.concatenate(rewards)
    keep = np.asarray(rx.losses.informative_groups(jnp.asarray(all_rewards), group_size=G))
    informative = np.flatnonzero(keep)[:n]
    rest = [g for g in range(n) if g not in set(informative)]
    return np.concatenate([informative, rest[: n - len(informative)]]).astype(np.int64), len(
        informative
    )


def _put(tree, device):
    return jax.tree.map(lambda x: jax.device_put(x, device) if eqx.is_array(x) else x, tree)


class SamplerPlacement:
    """Where a run's rollouts are sampled: `index` (`grpo.sampler_device`) is a local
    device (`jax.local_devices()[index]`) or `-1`, the device of the trained parameters.
    On its own device the sampler runs concurrently with the update on another; the
    behaviour parameters are copied to it for each rollout (the frozen part once) and
    the sampled rows are copied back to the trainer's device."""

    prompts = None  # the sampler's prompts stay where they are built

    def __init__(self, index: int):  # `index` checked by `validate_stage`
        self.device = None if index < 0 else jax.local_devices()[index]
        self.separate = self.device is not None
        self._frozen: tuple = (None, None)

    def trainer_state(self, state):
        return state

    def trainer_model(self, model):
        return model

    def info(self) -> dict:
        return {}

    def readable(self, pending):
        return pending

    def model(self, params, frozen):
        """The policy `params` + `frozen` on the sampler's device."""
        if self.device is None:
            return eqx.combine(params, frozen)
        if self._frozen[0] is not frozen:
            self._frozen = (frozen, _put(frozen, self.device))
        return eqx.combine(_put(params, self.device), self._frozen[1])

    def back(self, roll: Rollout, like) -> Rollout:
        """`roll`'s arrays on the device of the first array of `like`."""
        if self.device is None:
            return roll
        home = next(iter(jax.tree.leaves(eqx.filter(like, eqx.is_array))[0].devices()))
        return dataclasses.replace(roll, **{f: _put(getattr(roll, f), home) for f in _ROW_ARRAYS})


def grpo_state_and_step(pol, spec, cfg, ctx: RunContext, completion_budget: int | None = None):
    """The `TrainState` of the policy `pol` (trainable part `spec`) and the GRPO step of
    `cfg` at the run's sampling temperature (`rl_step_settings`: Dr.GRPO's normaliser the
    `completion_budget`, by default `ctx.max_new_tokens`), its optimiser scheduled over
    `cfg.rollouts * cfg.epochs` updates."""
    opt = build_optimizer(cfg.optim, cfg.rollouts * cfg.epochs)
    state = rx.train.init_train_state(pol, opt, filter_spec=spec)
    budget = ctx.max_new_tokens if completion_budget is None else completion_budget
    cfg = rl_step_settings(cfg, ctx.temperature, budget)
    return state, rx.train.make_grpo_step(opt, cfg, options=cfg.options)


def run_grpo(
    policy,
    tok,
    prompts: Sequence[str],
    *,
    reward: "RewardSource | Sequence[RewardFunction]",
    cfg: GRPOConfig,
    ctx: RunContext,
) -> RunResult:
    """GRPO (Shao et al. 2024): per rollout, `cfg.group_size` completions for each of
    `cfg.prompts_per_rollout` prompts, scored by `reward` (weighted reward functions on
    the decoded text, e.g. verifiable rewards; or any `RewardSource`: a reward model or
    ensemble, a judge, a process reward model's aggregated step scores); group-relative
    advantages; reference log-probs computed once per rollout (k3 KL with weight
    `cfg.beta`); `cfg.epochs` steps on the rollout with `old_logp` from the sampler.
    With `cfg.staleness`, `cfg.overlap`, `cfg.sampler_device`, `cfg.rollout_correction`,
    `cfg.dynamic_sampling` and `cfg.overlong_buffer` (see `GRPOConfig`): rollouts from a
    stale policy with the behaviour log-probs kept and `old_logp` the trained policy's,
    the next rollout prepared while the update runs (on its own device if asked),
    importance correction, DAPO's dynamic sampling and overlong shaping. Logs
    `frac_reward_zero_std` and an event when no group carries a signal. Stops early when
    the per-token KL to the reference exceeds `cfg.kl_target`.
    """
    validate_stage("grpo", cfg)
    check_partial_rollouts("grpo.partial_rollouts", cfg.partial_rollouts, ctx.max_new_tokens)
    check_overlong_buffer("grpo.overlong_buffer", cfg.overlong_buffer, ctx.max_new_tokens)
    source = as_reward_source(reward)
    k_lora, ctx_key = jax.random.split(ctx.key)
    pol, spec, reference = _policy_and_reference(policy, cfg.lora, k_lora)
    state, step = grpo_state_and_step(pol, spec, cfg, ctx)
    cfg = dataclasses.replace(cfg, temperature=ctx.temperature)
    placement = (
        SplitPlacement("grpo", cfg)
        if cfg.placement == "split"
        else SamplerPlacement(cfg.sampler_device)
    )
    k, n, G = cfg.staleness, cfg.prompts_per_rollout, cfg.group_size
    if cfg.placement == "split":  # the run's state and reference on the trainer mesh
        state = placement.trainer_state(state)
        reference = (
            rx.without_lora(state.model) if spec is not None else placement.trainer_model(reference)
        )
    if k:
        state = OffPolicyState(state, (state.params,) * k)
    # Off-policy, the sampler's log-probs are the behaviour policy's and `old_logp` is the
    # trained policy's: a separate pass when several epochs need it fixed, or for the
    # correction's exact ratio extremes; with one step per rollout and no correction the
    # step takes its own (detached) log-probs as `old_logp`, as TRL does.
    behaviour_kept = k > 0 or cfg.rollout_correction is not None
    recompute = cfg.rollout_correction is not None or (k > 0 and cfg.epochs > 1)
    overlap = k > 0 and cfg.overlap

    def dispatch(model, key, r, max_new_tokens=None):  # the run's, or a partial rollout's first
        pending = _dispatch_sample(
            model,
            tok,
            prompts,
            key,
            r,
            ctx=ctx
            if max_new_tokens is None
            else dataclasses.replace(ctx, max_new_tokens=max_new_tokens),
            per_rollout=n,
            group_size=G,
            place=placement.prompts,
        )
        return placement.readable(pending)  # on this host too where rows lie on other hosts

    def host_half(pending):  # decoding and the reward: host work, or the reward's device
        roll = placement.back(finish_rollout(pending, tok), reference)
        return roll, source.score(roll)

    def device_half(roll, scored):  # the reference pass, on the trainer's device
        ref_logp, info = _compare(roll, reference)
        rewards = np.asarray(scored.scores, np.float32)
        if cfg.overlong_buffer:
            # whole on this host (gathered where the rows lie on several processes)
            mask = rx.distributed.to_host(roll.completion_mask)
            lengths = jnp.asarray(mask.sum(axis=1), jnp.int32)
            penalty = rx.losses.overlong_penalty(
                lengths, max_length=ctx.max_new_tokens, buffer=cfg.overlong_buffer
            )
            info["overlong_penalty"] = float(np.mean(penalty))
            rewards = rewards + np.asarray(penalty, np.float32)
        return roll, ref_logp, info, scored, rewards

    def sample(model, key, r, attempt):
        return device_half(*host_half(dispatch(model, key, r + attempt * cfg.rollouts)))

    # With `overlap`, rollout r + 1 is prepared by a worker thread while rollout r's update
    # runs (compiled calls wait for their result, so the overlap is between threads): on
    # one device the sampler runs first and the worker decodes and scores during the
    # update; on a sampler of its own (`sampler_device`, `placement=split`) the worker
    # samples too, and runs up to `staleness` rollouts ahead: rollout r + j samples with
    # the policy of update r + j - staleness, known before update r for every
    # j <= staleness. `queued` holds the submitted rollouts and `ahead` the next one
    # finished, each with the stale parameters it was sampled with (the object kept in
    # the state): it is used when its iteration starts from the states the iterations
    # before it returned, not after a rollback or a resume (which restore copies).
    ahead: dict[int, tuple] = {}
    queued: dict[int, tuple] = {}
    depth = (k if placement.separate else 1) if overlap else 0
    worker = ThreadPoolExecutor(1, thread_name_prefix="rollout") if overlap else None
    partial = None
    if cfg.partial_rollouts:  # rollouts in segments, each by the newest policy known
        partial = PartialRollouts(
            staleness=k,
            segment=cfg.partial_rollouts,
            ctx=ctx,
            pad_id=tok.pad_id,
            place=placement.prompts,
            first=dispatch,
            finish=lambda pending: device_half(*host_half(pending)),
            key_of=lambda q: jax.random.split(jax.random.fold_in(ctx_key, q))[0],
            worker=worker,
        )

    def queue_rollouts(state, ts, r):
        """Submit rollouts r + 1 ... r + `depth` (those not queued yet), in order, each
        from its behaviour policy."""
        if partial is not None:  # started and continued by the sampler of its own
            if placement.separate:
                model = lambda p: placement.model(p, ts.frozen)  # noqa: E731
                partial.queue((*state.behind, ts.params), r, cfg.rollouts, depth, model)
            return
        for j in range(1, depth + 1):
            q = r + j
            if q >= cfg.rollouts or q in queued or q in ahead:
                continue
            params = (*state.behind, ts.params)[j]
            model = placement.model(params, ts.frozen)
            key = jax.random.split(jax.random.fold_in(ctx_key, q))[0]
            if not placement.separate:  # one device: sample now, not during the update
                pending = dispatch(model, key, q)
                jax.block_until_ready(pending.out)
                queued[q] = (params, worker.submit(host_half, pending))
            else:
                queued[q] = (
                    params,
                    worker.submit(lambda m=model, kk=key, qq=q: host_half(dispatch(m, kk, qq))),
                )

    def iteration(state, key, r):
        if cfg.placement == "split":  # a restored state comes back on the default device
            ts = placement.trainer_state(state.train if k else state)
            state = OffPolicyState(ts, state.behind) if k else ts
        ts = state.train if k else state
        behaviour = lambda: placement.model(state.behind[0] if k else ts.params, ts.frozen)  # noqa: E731
        k_sample, k_steps = jax.random.split(key)
        ready = ahead.pop(r, None)
        ahead.clear()
        prepared = ready is not None and ready[0] is state.behind[0]
        if not prepared:  # a rollback or a resume: the queued rollouts are another policy's
            for _, future in queued.values():
                future.cancel()
            queued.clear()
        if partial is not None:
            model = lambda p: placement.model(p, ts.frozen)  # noqa: E731
            prepared, (roll, ref_logp, info, scored, rewards) = partial.take(
                (*state.behind, ts.params), r, k_sample, model
            )
        elif prepared:
            roll, ref_logp, info, scored, rewards = ready[1]
        else:
            roll, ref_logp, info, scored, rewards = sample(behaviour(), k_sample, r, 0)
        if overlap:  # this rollout was prepared while the previous update ran
            info["overlapped"] = float(prepared)
        if cfg.dynamic_sampling:
            parts = [(roll, ref_logp, rewards)]
            while (
                len(parts) < cfg.dynamic_sampling
                and _dynamic_groups([p[2] for p in parts], n, G)[1] < n
            ):
                key_more = jax.random.fold_in(k_sample, len(parts))
                more = sample(behaviour(), key_more, r, len(parts))
                parts.append((more[0], more[1], more[4]))
            groups, found = _dynamic_groups([p[2] for p in parts], n, G)
            roll = _take_groups(_concat_rollouts([p[0] for p in parts]), groups, G)
            rows = (groups[:, None] * G + np.arange(G)[None, :]).reshape(-1)
            ref_logp = jnp.concatenate([p[1] for p in parts])[rows]
            rewards = np.concatenate([p[2] for p in parts])[rows]
            info["dynamic_sampling/samplings"] = float(len(parts))
            info["dynamic_sampling/informative"] = found / n
        info.update(scored.metrics, score=float(rewards.mean()))
        info["frac_reward_zero_std"] = group_signal(rewards, G)
        if info["frac_reward_zero_std"] == 1.0:
            ctx.log.event(
                "no_signal",
                no_signal_message(r, cfg.beta),
                iteration=r,
            )
        own = roll.completion_mask & roll.mask
        old_logp, behaviour_logp = roll.logprobs, None
        if behaviour_kept:
            old_logp, behaviour_logp = None, roll.logprobs
        if recompute:  # the trained policy's own log-probs; the sampler's are the behaviour's
            current = _policy_logps(ts.model, roll.tokens, roll.mask, ctx.temperature)
            old_logp = jnp.where(own, current, 0.0)
        batch = rx.train.GRPOBatch(
            tokens=roll.tokens,
            mask=roll.mask,
            completion_mask=roll.completion_mask,
            rewards=jnp.asarray(rewards),
            old_logp=old_logp,
            ref_logp=ref_logp,
            truncated=roll.truncated,
            prompt_length=ctx.prompt_length,  # each group's prompt runs once in the update
            samples_per_prompt=G,
            behaviour_logp=behaviour_logp,
        )
        if overlap:
            queue_rollouts(state, ts, r)
            if cfg.placement == "split":  # the sampler's queue after this iteration's submissions
                info["queued"] = float(len(queued) if partial is None else partial.in_flight)
        metrics = []
        before = ts.params
        for e in range(cfg.epochs):
            ts, met = ts.apply(step, batch, key=jax.random.fold_in(k_steps, e))
            metrics.append(met)
        if r + 1 in queued:  # sampled, decoded and scored while the update ran
            params, future = queued.pop(r + 1)
            ahead[r + 1] = (params, device_half(*future.result()))
        info.update(placement.info())  # this iteration's weight transfers
        if k:
            return OffPolicyState(ts, (*state.behind[1:], before)), metrics, info
        return ts, metrics, info

    rows = n * G * (ctx.prompt_length + ctx.max_new_tokens)
    ctx = dataclasses.replace(ctx, key=ctx_key)
    try:
        res = run_loop(
            state,
            iteration,
            ctx,
            cfg.rollouts,
            kl_target=cfg.kl_target,
            policy_of=(lambda s: s.train.model) if k else (lambda s: s.model),
            tokens_per_iteration=n * G * ctx.max_new_tokens,
            # Sampling and the reference pass, then `epochs` steps on the rollout.
            flops_per_iteration=model_flops(
                rx.count_params(pol), forward_tokens=2 * rows, train_tokens=cfg.epochs * rows
            ),
        )
    finally:
        if worker is not None:
            worker.shutdown(wait=False, cancel_futures=True)
    return dataclasses.replace(res, state=res.state.train) if k else res


def grpo(env: StageEnv, c: GRPOConfig) -> Outcome:
    """GRPO from SFT on the built-in task, rewards from `c.reward_source`."""
    res = scored_on_task(env, c, run_grpo, "grpo")
    return Outcome(res, policy=final_policy(res.state.model))


@dataclasses.dataclass(frozen=True)
class GRPOPrompts:
    """The prompts of GRPO on a data file (`grpo_prompts`): the `train` and `held`
    (held-out) prompts, `exact` (the exact-match reward function on the reference
    answers, also the held-out score; `None` when some prompt has no answer) and
    `reward`, the run's reward source (`grpo.reward_source`: `exact` for `task`, or the
    user's `grpo.reward_functions`)."""

    train: tuple[str, ...]
    held: tuple[str, ...]
    exact: RewardFunction | None
    reward: RewardSource


def grpo_prompts(env: StageEnv, c: GRPOConfig) -> GRPOPrompts:
    """The prompts of `env.cfg.data` as GRPO on a data file trains on them: read, through
    the chat template, those that fit `sampling.prompt_length`, split by `data.seed`
    (`split_records`). The exact-match reward (`reward_source=task` without
    `reward_functions`) keeps the prompts with a reference answer; the other rewards (the
    user's functions, given each prompt's other columns, a reward model, a judge, a PRM)
    need none and keep every prompt. `env.summary["data_quality"]` counts what was
    dropped and the repeated prompts; a `skipped_records` event names the lines the
    reader left out (`log_skipped`), a `prompts_left_out` event those left out here
    (without an answer, longer than `sampling.prompt_length`: `log_left_out`). A file
    without a usable prompt (no answer for the exact match, none that fits) is a
    `ValueError` naming it."""
    cfg, policy, tok = env.cfg, env.base, env.tok
    s = cfg.sampling
    log = env.ctx("").log
    prompts = data.load_prompts(cfg.data.path, cfg.data.format, **cfg.data.read_options())
    log_skipped(log, prompts.report)
    exact_match = c.reward_source == "task" and not c.reward_functions
    raw = [r for r in prompts if r.answer is not None or not exact_match]
    if not raw:
        raise ValueError(
            f"data.path={cfg.data.path}: none of its {len(prompts)} prompts has a reference "
            f"answer (format {prompts.report.format!r}); GRPO's exact-match reward needs "
            "answers, e.g. GSM8K's '#### <int>'; or score with your own functions "
            "(grpo.reward_functions=MODULE:NAME), grpo.reward_source=reward_model "
            "(grpo.reward_model=DIR), judge or prm"
            + (
                " (this looks like a preference file: run sft, reward or dpo on it)"
                if is_preference_file(cfg.data.path, **cfg.data.read_options())
                else ""
            )
        )
    usable = chat_records(env, raw, prompts)
    fits = [r for r in usable if prompt_tokens(tok, r.prompt) <= s.prompt_length]
    _log_left_out(log, cfg.data.path, prompts, raw, usable, fits, s.prompt_length)
    if not fits:
        longest = min(prompt_tokens(tok, r.prompt) for r in usable)
        raise ValueError(
            f"sampling.prompt_length={s.prompt_length}: no prompt fits (the shortest of "
            f"{len(usable)} prompts{' with answers' if exact_match else ''} has {longest} "
            "tokens with BOS); raise sampling.prompt_length"
        )
    env.say(
        f"grpo: {len(fits)} of {len(prompts)} prompts "
        f"{'have an answer and ' if exact_match else ''}fit "
        f"sampling.prompt_length={s.prompt_length}"
    )
    quality = {"skipped_by_reader": dict(prompts.report.skipped)}
    if exact_match:
        quality["without_answer"] = len(prompts) - len(usable)
    quality["duplicate_prompts"] = len(fits) - len({r.prompt for r in fits})
    quality["longer_than_prompt_length"] = len(usable) - len(fits)
    env.summary["data_quality"] = quality
    train, held = split_records(fits, cfg.data)
    reward, exact = prompt_file_reward(
        "grpo", c, fits, cfg.data.path, tokenizer=tok, judge=cfg.judge, judges={"base": policy}
    )
    prompts_of = lambda records: tuple(r.prompt for r in records)  # noqa: E731
    return GRPOPrompts(prompts_of(train), prompts_of(held), exact, reward)


def _log_left_out(log, path, prompts, raw: list, usable: list, fits: list, limit: int) -> None:
    """`log_left_out` of `grpo_prompts`: the prompts of the reader's dataset `prompts`
    (of the file `path`) left out without an answer (not in `raw`) and those too long for
    `sampling.prompt_length=limit` (of `usable`, the `raw` prompts through the chat
    template, those not in `fits`), named by their lines."""
    kept = {id(r) for r in raw}
    unanswered = [r for r in prompts if id(r) not in kept]
    fit = {id(r) for r in fits}
    long = [r for r in usable if id(r) not in fit]
    at = {**record_numbers(prompts, unanswered, unanswered), **record_numbers(prompts, raw, usable)}
    log_left_out(
        log,
        path,
        len(prompts),
        [
            ("without_answer", "without a reference answer", [at.get(id(r)) for r in unanswered]),
            (
                "long_prompt",
                f"longer than sampling.prompt_length={limit} with BOS",
                [at.get(id(r)) for r in long],
            ),
        ],
        "raise sampling.prompt_length to keep the long ones"
        + (
            "; grpo.reward_functions=MODULE:NAME (or another grpo.reward_source) scores "
            "prompts without an answer"
            if unanswered
            else ""
        ),
    )


def heldout_scores(env: StageEnv, prompts: GRPOPrompts, trained, reuse: dict | None = None) -> dict:
    """`summary["grpo"]` of GRPO on a data file: the held-out exact-match rate of the
    base model (`env.base`) and of the `trained` policy on paired samples
    (`sampled_comparison` of every held-out prompt with the key `ops.seed + 1` of
    `env.cfg`; `reuse` as there), with their standard errors over the prompts
    (`heldout_exact_match_before`, `heldout_exact_match`, `*_se`), when every prompt has
    a reference answer; else the run's reward of those samples (`prompts.reward`:
    `heldout_reward_before`, `heldout_reward`, `*_se`, as PPO on a data file reports
    it); the rest of the comparison as `sampled`."""
    cfg = env.cfg
    k = jax.random.key(cfg.ops.seed + 1)
    held = list(prompts.held)
    exact = prompts.exact
    scoring = dict(reward=prompts.reward) if exact is None else dict(score=exact.fn)
    ev = sampled_comparison(
        env.base, trained, env.tok, held, k, cfg, max_prompts=0, reuse=reuse, **scoring
    )
    if exact is None:
        return heldout_reward_summary(ev)
    return {
        "heldout_exact_match_before": ev.pop("score_before"),
        "heldout_exact_match_before_se": ev.pop("score_before_se"),
        "heldout_exact_match": ev.pop("score_after"),
        "heldout_exact_match_se": ev.pop("score_after_se"),
        "sampled": ev,
    }


def grpo_on_data(env: StageEnv, c: GRPOConfig) -> Outcome:
    """GRPO on a prompt file (`grpo_prompts`): the exact-match reward of the reference
    answers, or `c.reward_functions`, or `c.reward_source`; the held-out exact-match
    rate, or without every answer the held-out reward, before and after
    (`heldout_scores`)."""
    ctx = env.ctx("")
    prompts = grpo_prompts(env, c)
    res = run_grpo(env.base, env.tok, list(prompts.train), reward=prompts.reward, cfg=c, ctx=ctx)
    trained = trained_policy(env, res.state.model)
    env.summary["grpo"] = heldout_scores(env, prompts, trained)
    return Outcome(res, policy=trained)


PLACEMENT_FIELDS: tuple[str, ...] = (
    "overlap",
    "sampler_device",
    "placement",
    "trainer_devices",
    "sampler_devices",
    "trainer_mesh",
    "sampler_mesh",
)
"""The GRPO settings of when and where the next rollout is sampled, not of what it is:
they may change on resume (the stage's `resumable`)."""


register_stage(
    Stage(
        "grpo",
        GRPOConfig,
        grpo,
        grpo_on_data,
        needs=lambda cfg: scored_needs(cfg, "grpo"),
        sections=("sft", "judge"),
        help="GRPO, rewards from grpo.reward_source",
        check_run=_check_run,
        task=dict(
            rollouts=12,
            prompts_per_rollout=8,
            group_size=8,
            beta=0.02,
            kl_target=1.0,
            optim=_optim(2e-3),
        ),
        resumable=PLACEMENT_FIELDS,
        key_stream=("split", 5),
    )
)
