"""Policy (LM head), value model (per-token scalar) and reward model (scalar at the last real
token)."""

import abc
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._config import TransformerConfig
from ._layers import AbstractQuantizedWeight, matmul, normal_init, softcap, vary_like
from ._masks import attention_layout, previous_allowed
from ._packing import branch_last_index
from ._protocols import (
    AbstractBatchedModel,
    AbstractBranchScorer,
    AbstractChunkDecoder,
    AbstractScalarModel,
    AbstractSelectiveLM,
    AbstractSequenceModel,
)
from ._transformer import KVCache, Transformer


def last_real_index(mask: Bool[Array, "*B T"]) -> Int[Array, "*B"]:
    """Index of the last real position (0 when the mask is empty)."""
    T = mask.shape[-1]
    positions = jnp.arange(T, dtype=jnp.int32).reshape((1,) * (mask.ndim - 1) + (T,))
    return jnp.max(jnp.where(mask, positions, 0), axis=-1)


def _previous_real(mask: Bool[Array, "N T"]) -> tuple[Int[Array, "N T"], Bool[Array, "N T"]]:
    """Per row, the index of the last real position before each position (0 where there
    is none) and whether there is one (`rlhf_eqx.ops.previous_real_index`, batched)."""
    T = mask.shape[-1]
    idx = jnp.where(mask, jnp.arange(T, dtype=jnp.int32)[None, :], -1)
    running = jax.lax.cummax(idx, axis=1)
    prev = jnp.concatenate([jnp.full((mask.shape[0], 1), -1, jnp.int32), running[:, :-1]], axis=1)
    return jnp.maximum(prev, 0), prev >= 0


# `selected_logprobs` unrolls up to this many head chunks in the program (a scan beyond)
_UNROLLED_CHUNKS = 16


class _BackboneModel(eqx.Module):
    """A `Transformer` and a read-out of its final hidden states (the base of `Policy`,
    `ValueModel` and `RewardModel`). The call applies the read-out at every position;
    `RewardModel`'s replaces it with a read at the last real token."""

    transformer: Transformer

    @property
    def cfg(self) -> TransformerConfig:
        return self.transformer.cfg

    @abc.abstractmethod
    def _read_out(self, h: Float[Array, "*T D"]) -> Float[Array, "..."]:
        raise NotImplementedError

    def __call__(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        *,
        segment_ids: Int[Array, "*B T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "..."]:
        return self._read_out(self.transformer(tokens, mask, segment_ids=segment_ids, key=key))


class Policy(
    _BackboneModel, AbstractChunkDecoder[KVCache], AbstractBatchedModel, AbstractSelectiveLM
):
    """A causal language model: `policy(tokens, mask) -> logits [T, V]` (float32).

    Written for one sequence; a batch `[B, T]` may also be passed directly (the result
    equals `jax.vmap(policy)`, but the projections run as flat 2-D products, which is
    faster on CPU — the step builders do this).

    `logits[t]` is the distribution of the token after position `t`. With
    `cfg.tie_embeddings` the head is the embedding matrix (`lm_head` is `None`); a
    quantised one (`(in, out) = (D, V)`) goes through the frozen product `matmul`.
    """

    lm_head: Float[Array, "D V"] | AbstractQuantizedWeight | None

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(cfg, key=kt)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            (self.lm_head,) = normal_init(
                kh, shapes=((cfg.d_model, cfg.vocab_size),), scales=(0.02,), dtype=cfg.param_dtype
            )

    @property
    def vocab_size(self) -> int:
        return self.transformer.cfg.vocab_size

    def init_cache(self, cache_size: int) -> KVCache:
        """An empty cache with `cache_size` slots (the layout `prefill` returns)."""
        cfg = self.cfg
        shape = (cfg.n_layers, cfg.n_kv_heads, cache_size, cfg.head_dim)
        return KVCache(
            k=jnp.zeros(shape[:2] + (cfg.head_dim, cache_size), cfg.param_dtype),
            v=jnp.zeros(shape, cfg.param_dtype),
            mask=jnp.zeros((cache_size,), jnp.bool_),
            positions=jnp.zeros((cache_size,), jnp.int32),
        )

    def logits_from_hidden(self, hidden: Float[Array, "*T D"]) -> Float[Array, "*T V"]:
        """Apply the LM head (float32 accumulation; soft-capped with `cfg.final_softcap`)."""
        w = self.transformer.embed if self.lm_head is None else self.lm_head
        tied = self.lm_head is None and not isinstance(w, AbstractQuantizedWeight)
        logits = matmul(hidden, w, out_dtype=jnp.float32, transposed=tied)
        return softcap(logits, self.cfg.final_softcap)

    def _head_varying_like(self, h: Array) -> "Policy":
        """`self` with the LM head's weight cast to vary over the manual device axes `h`
        varies over (`vary_like`); `self` outside `jax.shard_map`."""
        if self.lm_head is None:
            return eqx.tree_at(
                lambda p: p.transformer.embed, self, vary_like(h, self.transformer.embed)
            )
        return eqx.tree_at(lambda p: p.lm_head, self, vary_like(h, self.lm_head))

    def _read_out(self, h: Float[Array, "*T D"]) -> Float[Array, "*T V"]:
        return self.logits_from_hidden(h)

    def selected_logprobs(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        select: Bool[Array, "*B T"],
        *,
        segment_ids: Int[Array, "*B T"] | None = None,
        branch_ids: Int[Array, "*B T"] | None = None,
        regions: tuple[int, ...] | None = None,
        key: PRNGKeyArray | None = None,
        chunk: int = 512,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[Float[Array, "*B T"], ...]:
        """Log-probabilities of the selected tokens, with the LM head applied only where needed.

        Equals `logprobs_from_logits(policy(tokens, mask), tokens, mask)` at the tokens
        where `select & mask` holds and a real token precedes (0 elsewhere), but the
        head and the vocabulary log-softmax run only on the hidden states that predict
        those tokens: their positions are gathered (all rows together, selected first),
        cut into chunks of `chunk` positions (unrolled up to 16 chunks, a scan beyond),
        and chunks holding no selected position are skipped (`jax.lax.cond`, forward
        and backward; in multi-process runs every chunk is scored, so that no collective
        runs inside a conditional). The `[T, V]` logits are never materialised as one
        array: without a gradient at most `[chunk, V]` are alive at a time; a
        differentiated call keeps each scored chunk's logits for its backward pass.

        **Arguments:**

        - `tokens`, `mask`: as for `__call__` (one sequence or a batch).
        - `select`: which tokens to score (e.g. a completion mask).
        - `segment_ids`, `branch_ids`, `regions`: the packed layout
          (`Transformer.__call__`); a token is then predicted from the last earlier
          position it may attend to (for the first token of a branch: the shared
          prefix's last token).
        - `key`: LoRA dropout key, as for `__call__`.
        - `chunk`: positions per head chunk (a positive int).
        - `temperature`: the log-softmax is taken of `logits / temperature` (as
          `logprobs_from_logits(..., temperature=)`; e.g. the sampling temperature of
          GRPO / PPO rollouts).
        - `with_entropy`: also return the entropy of each predictive distribution
          (`entropy_from_logits`), computed in the same chunks; it carries no gradient
          (a metric: no backward work is spent on it).

        **Returns:** `(logp, mean_logit)`, or `(logp, mean_logit, entropy)` with
        `with_entropy`, each `[..., T]` float32: `logp[t] = log p(tokens[t] |
        tokens[<t])` and `mean_logit[t]` the mean over the vocabulary of the
        (temperature-scaled) logits that predicted token `t`, at the scored tokens, 0
        elsewhere.
        """
        if chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}")
        h = self.transformer(
            tokens, mask, segment_ids=segment_ids, branch_ids=branch_ids, regions=regions, key=key
        )
        lead, T = tokens.shape[:-1], tokens.shape[-1]
        flat_mask = mask.reshape(-1, T)
        if segment_ids is None and branch_ids is None:
            prev, has_prev = _previous_real(flat_mask)
        else:
            allowed, _ = attention_layout(mask, segment_ids, branch_ids)
            prev, has_prev = previous_allowed(allowed)
            prev, has_prev = prev.reshape(-1, T), has_prev.reshape(-1, T)
        valid = (select.reshape(-1, T) & flat_mask & has_prev).reshape(-1)
        N = valid.shape[0]
        rows = jnp.arange(N, dtype=jnp.int32) // T
        src = rows * T + prev.reshape(-1).astype(jnp.int32)
        # selected positions first (stable), padded up to whole chunks
        order = jnp.argsort(~valid, stable=True)
        n_chunks = -(-N // chunk)
        pad = n_chunks * chunk - N
        order = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)])
        hs = h.reshape(N, -1)[src[order]].reshape(n_chunks, chunk, -1)
        tgt = tokens.reshape(-1)[order].reshape(n_chunks, chunk)
        count = jnp.sum(valid, dtype=jnp.int32)
        starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk

        n_out = 3 if with_entropy else 2

        # the head's weights vary over the device axes the rows do (under shard_map),
        # so that a skipped chunk's branch and the backward's sum stay out of the cond
        head = self._head_varying_like(h)

        def scored(args):
            hc, tc = args
            logits = head.logits_from_hidden(hc).astype(jnp.float32)
            if temperature != 1.0:
                logits = logits / temperature
            lse = jax.nn.logsumexp(logits, axis=-1)
            target = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
            out = (target - lse, jnp.mean(logits, axis=-1))
            if with_entropy:
                lg, ls = jax.lax.stop_gradient((logits, lse))
                out += (ls - jnp.sum(jnp.exp(lg - ls[:, None]) * lg, axis=-1),)
            return out

        def skipped(args):
            # of the chunk's type under shard_map (varying over the axes the rows vary over)
            return (vary_like(args[0], jnp.zeros((chunk,), jnp.float32)),) * n_out

        # Across processes the head's weights may be sharded, and a collective inside a
        # conditional can run concurrently with another collective in a different order
        # on each process (XLA's CPU runtime executes independent operations in
        # parallel), which deadlocks; there every chunk is scored.
        skip_empty = jax.process_count() == 1

        def body(_, xs):
            hc, tc, start = xs
            if not skip_empty:
                return None, scored((hc, tc))
            return None, jax.lax.cond(start < count, scored, skipped, (hc, tc))

        if n_chunks <= _UNROLLED_CHUNKS:
            # separate buffers per chunk: a scan's stacked residuals ([n_chunks, chunk, V]
            # logits, 75 MB for 9 chunks of 512 at V = 4096) are zero-filled and written
            # by XLA before the backward reads them (DPO step 3%, GRPO update 5% faster)
            per_chunk = [body(None, (hs[c], tgt[c], starts[c]))[1] for c in range(n_chunks)]
            outs = tuple(jnp.stack(x) for x in zip(*per_chunk))
        else:
            _, outs = jax.lax.scan(body, None, (hs, tgt, starts))
        inverse = jnp.argsort(order[:N], stable=True)
        keep = valid.reshape(-1)
        back = lambda x: jnp.where(keep, x.reshape(-1)[:N][inverse], 0.0).reshape(lead + (T,))
        return tuple(back(x) for x in outs)

    def prefill(
        self, tokens: Int[Array, " P"], mask: Bool[Array, " P"], *, cache_size: int
    ) -> tuple[Float[Array, " V"], KVCache]:
        """Run a prompt; return the next-token logits after its last real token and the cache."""
        h, cache = self.transformer.prefill(tokens, mask, cache_size=cache_size)
        return self.logits_from_hidden(h[last_real_index(mask)]), cache

    def decode_step(
        self,
        token: Int[Array, ""],
        cache: KVCache,
        *,
        index: Int[Array, ""] | int,
        position: Int[Array, ""],
    ) -> tuple[Float[Array, " V"], KVCache]:
        """Feed one token; return the next-token logits and the updated cache."""
        h, cache = self.transformer.decode_step(token, cache, index=index, position=position)
        return self.logits_from_hidden(h), cache

    def decode_chunk(
        self,
        tokens: Int[Array, " C"],
        cache: KVCache,
        *,
        index: Int[Array, ""] | int,
        position: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "C V"], KVCache]:
        """Feed `C` tokens in one pass (`Transformer.decode_chunk`); return their
        next-token logits and the cache, whose slots after the chunk are dropped."""
        h, cache = self.transformer.decode_chunk(tokens, cache, index=index, position=position)
        return self.logits_from_hidden(h), cache


class _ScalarHeadModel(_BackboneModel):
    """A backbone plus a linear scalar read-out (shared by `ValueModel` and `RewardModel`)."""

    head: Float[Array, " D"]
    bias: Float[Array, ""]

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(cfg, key=kt)
        scale = 1.0 / math.sqrt(cfg.d_model + 1.0)
        (self.head,) = normal_init(kh, shapes=((cfg.d_model,),), scales=(scale,), dtype=jnp.float32)
        self.bias = jnp.zeros((), jnp.float32)

    @classmethod
    def from_policy(cls, policy: Policy, *, key: PRNGKeyArray):
        """A model on `policy`'s backbone (the same arrays) with a fresh scalar head."""
        model = cls(policy.cfg, key=key)
        return eqx.tree_at(lambda m: m.transformer, model, policy.transformer)

    def _read_out(self, h: Float[Array, "*T D"]) -> Float[Array, "*T"]:
        return matmul(h, self.head[:, None], out_dtype=jnp.float32)[..., 0] + self.bias


class ValueModel(_ScalarHeadModel, AbstractSequenceModel, AbstractBatchedModel):
    """A critic: `value(tokens, mask) -> values [T]`, one scalar per position (float32).

    `values[t]` estimates the return from the state after token `t`.
    """


class RewardModel(
    _ScalarHeadModel, AbstractScalarModel, AbstractBatchedModel, AbstractBranchScorer
):
    """A scalar reward: `reward(tokens, mask) -> r`, read at the last real token (float32)."""

    def __call__(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*B"]:
        last = self.transformer.hidden_at(tokens, mask, last_real_index(mask)[..., None], key=key)
        return self._read_out(last[..., 0, :])

    def branch_scores(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        segment_ids: Int[Array, "*B T"],
        branch_ids: Int[Array, "*B T"],
        *,
        num_segments: int,
        num_branches: int = 2,
        regions: tuple[int, ...] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*B K n"]:
        """Rewards of shared-prefix packed rows (`PackedPreferenceBatch`): `out[..., k, b-1]`
        is the reward of segment `k`'s prefix followed by its branch `b`, read at that
        branch's last real token, equal to `self(prefix + branch)` unpacked. `regions`:
        see `Transformer.__call__`."""
        idx = branch_last_index(
            mask, segment_ids, branch_ids, num_segments=num_segments, num_branches=num_branches
        )
        flat = idx.reshape(idx.shape[:-2] + (-1,))
        picked = self.transformer.hidden_at(
            tokens,
            mask,
            flat,
            segment_ids=segment_ids,
            branch_ids=branch_ids,
            regions=regions,
            key=key,
        )
        return self._read_out(picked).reshape(idx.shape)
