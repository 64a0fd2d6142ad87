"""Per-pair sequence log-probabilities of preference batches (unpacked or shared-prompt
packed), and the reference model's, computed once (`compute_reference_logps`)."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..data import PackedPreferenceBatch, PreferenceBatch
from ..models import AbstractSelectiveLM, branch_sums
from ..ops import logprobs_from_logits, masked_sum, previous_real_index
from ._accumulate import _set_fields, policy_logits


def _forward(model, tokens, mask, completion_mask, key):
    """Token log-probs `[b, T]`, summed completion log-probs `[b]`, mean-logit sums `[b]`.

    A model that meets `AbstractSelectiveLM` (e.g. `Policy`) applies its LM head only at
    the positions that predict completion tokens; any other model returns full logits.
    """
    m = completion_mask & mask
    if isinstance(model, AbstractSelectiveLM):
        logp, mean_logit = model.selected_logprobs(tokens, mask, m, key=key)
        return logp, masked_sum(logp, m, axis=-1), masked_sum(mean_logit, m, axis=-1)
    logits = policy_logits(model, tokens, mask, key)
    logp = jax.vmap(logprobs_from_logits)(logits, tokens, mask)
    seq = masked_sum(logp, m, axis=-1)
    prev, _ = jax.vmap(previous_real_index)(mask)
    mean_logit = jnp.take_along_axis(jnp.mean(logits.astype(jnp.float32), axis=-1), prev, axis=-1)
    return logp, seq, masked_sum(mean_logit, m, axis=-1)


def _pair_forward(model, batch: PreferenceBatch, cm, rm, key):
    """`_forward` over the chosen and rejected rows as one batch `[2b, T]` (one pass of
    the model instead of two); returns the chosen and the rejected halves."""
    b = batch.chosen_tokens.shape[0]
    cat = lambda x, y: jnp.concatenate([x, y], axis=0)
    logp, seq, logit = _forward(
        model,
        cat(batch.chosen_tokens, batch.rejected_tokens),
        cat(batch.chosen_mask, batch.rejected_mask),
        cat(cm, rm),
        key,
    )
    return (logp[:b], seq[:b], logit[:b]), (logp[b:], seq[b:], logit[b:])


class _PairLogps(eqx.Module):
    """Per pair: summed completion log-probs, summed mean logits and completion lengths
    of the chosen and rejected completions, the pair weights (1 for a real pair) and the
    chosen token-level log-probs with their mask (for the RPO term)."""

    chosen: Array
    rejected: Array
    chosen_logit: Array
    rejected_logit: Array
    chosen_len: Array
    rejected_len: Array
    weight: Array
    chosen_tokens_logp: Array
    chosen_tokens_mask: Array


def _packed_forward(model, batch: PackedPreferenceBatch, key) -> _PairLogps:
    """One pass of a selective LM over shared-prefix packed rows, read out per pair slot."""
    if not isinstance(model, AbstractSelectiveLM):
        raise ValueError(
            f"a PackedPreferenceBatch needs a model that meets rlhf_eqx.models.AbstractSelectiveLM "
            f"(e.g. rlhf_eqx.Policy); {type(model).__name__} does not: use a PreferenceBatch"
        )
    sel = batch.completion_mask & batch.mask
    logp, mean_logit = model.selected_logprobs(
        batch.tokens,
        batch.mask,
        sel,
        segment_ids=batch.segment_ids,
        branch_ids=batch.branch_ids,
        regions=batch.regions,
        key=key,
    )
    K = batch.pairs.shape[-1]
    sums = lambda v: branch_sums(
        v, sel, batch.segment_ids, batch.branch_ids, num_segments=K
    ).reshape(-1, 2)
    seq, logit, count = sums(logp), sums(mean_logit), sums(jnp.ones_like(logp))
    return _PairLogps(
        chosen=seq[:, 0],
        rejected=seq[:, 1],
        chosen_logit=logit[:, 0],
        rejected_logit=logit[:, 1],
        chosen_len=count[:, 0],
        rejected_len=count[:, 1],
        weight=batch.pairs.reshape(-1).astype(jnp.float32),
        chosen_tokens_logp=logp,
        chosen_tokens_mask=sel & (batch.branch_ids == 1),
    )


def _pairs_forward(model, batch, key) -> _PairLogps:
    """Per-pair log-probabilities of either batch layout."""
    if isinstance(batch, PackedPreferenceBatch):
        return _packed_forward(model, batch, key)
    cm = batch.chosen_completion_mask & batch.chosen_mask
    rm = batch.rejected_completion_mask & batch.rejected_mask
    (c_tok, c, c_logit), (_, r, r_logit) = _pair_forward(model, batch, cm, rm, key)
    f32 = jnp.float32
    return _PairLogps(
        chosen=c,
        rejected=r,
        chosen_logit=c_logit,
        rejected_logit=r_logit,
        chosen_len=jnp.sum(cm, axis=-1).astype(f32),
        rejected_len=jnp.sum(rm, axis=-1).astype(f32),
        weight=jnp.ones(c.shape, f32),
        chosen_tokens_logp=c_tok,
        chosen_tokens_mask=cm,
    )


def _cached_reference(batch):
    rc, rr = batch.ref_chosen_logp, batch.ref_rejected_logp
    if isinstance(batch, PackedPreferenceBatch):
        rc, rr = rc.reshape(-1), rr.reshape(-1)
    return rc, rr


def sequence_logps(
    model: Callable[..., Float[Array, "T V"]],
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    completion_mask: Bool[Array, "B T"],
) -> Float[Array, " B"]:
    r"""Summed completion log-probabilities
    $\sum_{t \in \text{completion}} \log\pi(y_t \mid y_{<t})$ of each row."""
    return _forward(model, tokens, mask, completion_mask, None)[1]


@eqx.filter_jit
def _reference_logps(reference_model, batch):
    out = _pairs_forward(reference_model, batch, None)
    c, r = jax.lax.stop_gradient(out.chosen), jax.lax.stop_gradient(out.rejected)
    if isinstance(batch, PackedPreferenceBatch):
        c, r = c.reshape(batch.pairs.shape), r.reshape(batch.pairs.shape)
    return c, r


def compute_reference_logps(
    reference_model: Callable[..., Float[Array, "T V"]],
    batch: PreferenceBatch | PackedPreferenceBatch,
) -> PreferenceBatch | PackedPreferenceBatch:
    """Fill `batch.ref_chosen_logp` / `ref_rejected_logp` with the reference model's
    summed completion log-probabilities (one jitted forward pass over the batch; `[B]`
    for a `PreferenceBatch`, `[R, K]` for a `PackedPreferenceBatch`).

    Run it once per batch before training (TRL `precompute_ref_log_probs`) and use
    `make_dpo_step(..., reference="cached")`: the step then skips the reference forward
    (about a quarter of a DPO step's compute).
    """
    c, r = _reference_logps(reference_model, batch)
    return _set_fields(batch, ref_chosen_logp=c, ref_rejected_logp=r)
