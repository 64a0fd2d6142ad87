"""Policy (LM head), value model (per-token scalar) and reward model (scalar at the last real token)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._config import TransformerConfig
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
            w = 0.02 * jax.random.normal(kh, (cfg.d_model, cfg.vocab_size), jnp.float32)
            self.lm_head = w.astype(cfg.param_dtype)

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


def _scalar_head(cfg: TransformerConfig, key: PRNGKeyArray) -> Float[Array, " D"]:
    return (jax.random.normal(key, (cfg.d_model,), jnp.float32) / jnp.sqrt(cfg.d_model + 1.0)).astype(
        jnp.float32
    )


class ValueModel(eqx.Module):
    """A critic: `value(tokens, mask) -> values [T]`, one scalar per position (float32).

    `values[t]` estimates the return from the state after token `t`.
    """

    transformer: Transformer
    head: Float[Array, " D"]
    bias: Float[Array, ""]

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(cfg, key=kt)
        self.head = _scalar_head(cfg, kh)
        self.bias = jnp.zeros((), jnp.float32)

    @property
    def cfg(self) -> TransformerConfig:
        return self.transformer.cfg

    @classmethod
    def from_policy(cls, policy: Policy, *, key: PRNGKeyArray) -> "ValueModel":
        """A critic sharing a copy of `policy`'s backbone, with a fresh head."""
        model = cls(policy.cfg, key=key)
        return eqx.tree_at(lambda m: m.transformer, model, policy.transformer)

    def __call__(
        self,
        tokens: Int[Array, " T"],
        mask: Bool[Array, " T"],
        *,
        segment_ids: Int[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " T"]:
        h = self.transformer(tokens, mask, segment_ids=segment_ids, key=key)
        return jnp.matmul(h, self.head.astype(h.dtype), preferred_element_type=jnp.float32) + self.bias


class RewardModel(eqx.Module):
    """A scalar reward: `reward(tokens, mask) -> r`, read at the last real token (float32)."""

    transformer: Transformer
    head: Float[Array, " D"]
    bias: Float[Array, ""]

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(cfg, key=kt)
        self.head = _scalar_head(cfg, kh)
        self.bias = jnp.zeros((), jnp.float32)

    @property
    def cfg(self) -> TransformerConfig:
        return self.transformer.cfg

    @classmethod
    def from_policy(cls, policy: Policy, *, key: PRNGKeyArray) -> "RewardModel":
        """A reward model on `policy`'s backbone with a fresh scalar head."""
        model = cls(policy.cfg, key=key)
        return eqx.tree_at(lambda m: m.transformer, model, policy.transformer)

    def __call__(
        self,
        tokens: Int[Array, " T"],
        mask: Bool[Array, " T"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, ""]:
        h = self.transformer(tokens, mask, key=key)
        last = h[last_real_index(mask)]
        return jnp.dot(last, self.head.astype(last.dtype), preferred_element_type=jnp.float32) + self.bias
