"""A self-speculative draft: the policy's own first layers with its final norm and LM head."""

import copy
import dataclasses
import numbers

import equinox as eqx
import jax

from ._heads import Policy


def truncated_draft(policy: Policy, n_layers: int) -> Policy:
    """The `Policy` made of `policy`'s first `n_layers` decoder layers, followed by its
    final RMSNorm and LM head (self-speculative decoding's draft: Zhang et al. 2024,
    "Draft & Verify"; Elhoushi et al. 2024, "LayerSkip").

    The layers are stacked along a leading axis (and run by `lax.scan`), so the draft's
    layers are that stack's first `n_layers` entries; the embedding, final norm and head
    are the same arrays as `policy`'s. The draft shares the vocabulary, so it can
    propose tokens for `generate_speculative(policy, draft, ...)`; it costs about
    `n_layers / cfg.n_layers` of a decode step of the policy (plus the head).

    **Arguments:**

    - `policy`: a `Policy` (dense or quantised weights, with or without LoRA adapters).
    - `n_layers`: how many of its layers to keep, `1 ≤ n_layers ≤ cfg.n_layers`.

    **Returns:** a `Policy` whose `cfg` is `policy.cfg` with `n_layers` (and
    `window_layers`, when set) cut to the kept layers.
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            f"truncated_draft: policy must be an rlhf_eqx.Policy, got {type(policy).__name__}"
        )
    total = policy.cfg.n_layers
    if not (isinstance(n_layers, numbers.Integral) and not isinstance(n_layers, bool)):
        raise ValueError(f"truncated_draft: n_layers must be an int, got {n_layers!r}")
    if not 1 <= n_layers <= total:
        raise ValueError(
            f"truncated_draft: n_layers must be in [1, {total}] (the policy's layers), "
            f"got {n_layers}"
        )
    n = int(n_layers)
    cfg = policy.cfg
    window_layers = None if cfg.window_layers is None else cfg.window_layers[:n]
    cfg = dataclasses.replace(cfg, n_layers=n, window_layers=window_layers)
    layers = jax.tree.map(lambda a: a[:n] if eqx.is_array(a) else a, policy.transformer.layers)
    if layers.lora is not None:  # per-layer adapters' static ranks, cut as their arrays are
        lora = {name: _first_ranks(adapter, n) for name, adapter in layers.lora.items()}
        layers = copy.copy(layers)
        object.__setattr__(layers, "lora", lora)
    transformer = eqx.tree_at(lambda t: t.layers, policy.transformer, layers)
    # the config is a static field, out of `tree_at`'s reach, and `Transformer.__init__`
    # draws fresh weights: set it on a copy
    transformer = copy.copy(transformer)
    object.__setattr__(transformer, "cfg", cfg)
    return eqx.tree_at(lambda p: p.transformer, policy, transformer)


def _first_ranks(adapter, n: int):
    """`adapter` (a stacked LoRA or DoRA adapter) with its static per-layer `ranks`, when
    it has them (`LayerwiseLoRAAdapter`, `DoRAAdapter`), cut to the first `n` layers."""
    ranks = getattr(adapter, "ranks", None)
    if not isinstance(ranks, tuple):
        return adapter
    out = copy.copy(adapter)
    object.__setattr__(out, "ranks", ranks[:n])
    return out
