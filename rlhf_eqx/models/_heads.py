"""Policy (LM head), value model (per-token scalar) and reward model (scalar at the last real token)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._config import TransformerConfig
from ._layers import normal_init
from ._transformer import KVCache, Transformer

__all__ = ["Policy", "ValueModel", "RewardModel", "last_real_index"]


def last_real_index(mask: Bool[Array, " T"]) -> Int[Array, ""]:
    """Index of the last real position (0 when the mask is empty)."""
    (T,) = mask.shape
    return jnp.max(jnp.where(mask, jnp.arange(T, dtype=jnp.int32), 0))


class Policy(eqx.Module):
    """A causal language model: `policy(tokens, mask) -> logits [T, V]` (float32).

    `logits[t]` is the distribution of the token after position `t`. With
    `cfg.tie_embeddings` the head is the embedding matrix (`lm_head` is `None`).
    """

    transformer: Transformer
    lm_head: Float[Array, "D V"] | None

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
    def cfg(self) -> TransformerConfig:
        return self.transformer.cfg

    def logits_from_hidden(self, hidden: Float[Array, "*T D"]) -> Float[Array, "*T V"]:
        """Apply the LM head (float32 accumulation)."""
        if self.lm_head is None:
            w = self.transformer.embed.T
        else:
            w = self.lm_head
        return jnp.matmul(hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens: Int[Array, " T"],
        mask: Bool[Array, " T"],
        *,
        segment_ids: Int[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T V"]:
        return self.logits_from_hidden(self.transformer(tokens, mask, segment_ids=segment_ids, key=key))

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


class _ScalarHeadModel(eqx.Module):
    """A backbone plus a linear scalar read-out (shared by `ValueModel` and `RewardModel`)."""

    transformer: Transformer
    head: Float[Array, " D"]
    bias: Float[Array, ""]

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(cfg, key=kt)
        scale = 1.0 / math.sqrt(cfg.d_model + 1.0)
        (self.head,) = normal_init(kh, shapes=((cfg.d_model,),), scales=(scale,), dtype=jnp.float32)
        self.bias = jnp.zeros((), jnp.float32)

    @property
    def cfg(self) -> TransformerConfig:
        return self.transformer.cfg

    @classmethod
    def from_policy(cls, policy: Policy, *, key: PRNGKeyArray):
        """A model on `policy`'s backbone (the same arrays) with a fresh scalar head."""
        model = cls(policy.cfg, key=key)
        return eqx.tree_at(lambda m: m.transformer, model, policy.transformer)

    def _read_out(self, h: Float[Array, "*T D"]) -> Float[Array, "*T"]:
        return jnp.matmul(h, self.head.astype(h.dtype), preferred_element_type=jnp.float32) + self.bias


class ValueModel(_ScalarHeadModel):
    """A critic: `value(tokens, mask) -> values [T]`, one scalar per position (float32).

    `values[t]` estimates the return from the state after token `t`.
    """

    def __call__(
        self,
        tokens: Int[Array, " T"],
        mask: Bool[Array, " T"],
        *,
        segment_ids: Int[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " T"]:
        return self._read_out(self.transformer(tokens, mask, segment_ids=segment_ids, key=key))


class RewardModel(_ScalarHeadModel):
    """A scalar reward: `reward(tokens, mask) -> r`, read at the last real token (float32)."""

    def __call__(
        self,
        tokens: Int[Array, " T"],
        mask: Bool[Array, " T"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, ""]:
        h = self.transformer(tokens, mask, key=key)
        return self._read_out(h[last_real_index(mask)])
