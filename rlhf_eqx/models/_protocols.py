r"""The model protocols: what a model must provide to run rlhf_eqx's steps and sampler.

rlhf_eqx never asks *which* class a model is; it asks which of these abstract
`eqx.Module`s the model inherits. Any model that subclasses them and implements their
methods runs every step builder and the sampler, exactly as rlhf_eqx's own models do.

| protocol | call | rlhf_eqx models | used by |
| --- | --- | --- | --- |
| `AbstractSequenceModel` | `model(tokens Int[" T"], mask Bool[" T"], *, key=None) -> Float["T ..."]` | `Transformer`, `Policy`, `ValueModel` | SFT / DPO / PPO / GRPO steps (`[T, V]` logits), critics (`[T]` values) |
| `AbstractBatchedModel` | the same call also accepts `[B, T]` and returns what `jax.vmap(model)` would | `Transformer`, `Policy`, `ValueModel`, `RewardModel` | steps call it on the batch directly instead of vmapping |
| `AbstractScalarModel` | `model(tokens Int[" T"], mask Bool[" T"], *, key=None) -> Float[""]` | `RewardModel` | reward-model step, reward scoring |
| `AbstractSelectiveLM` | `model.selected_logprobs(tokens, mask, select, *, segment_ids=None, branch_ids=None, key=None, temperature=1.0, with_entropy=False)` | `Policy` | DPO and GRPO steps: LM head on completion positions only; shared-prefix packed batches |
| `AbstractBranchScorer` | `model.branch_scores(tokens, mask, segment_ids, branch_ids, *, num_segments)` | `RewardModel` | reward-model step on shared-prefix packed batches |
| `AbstractDecoder[Cache]` | `init_cache`, `prefill`, `decode_step`, `vocab_size` (and a sequence-model call) | `Policy` (cache `KVCache`) | `generate`, `generate_batch` |
| `AbstractChunkDecoder[Cache]` | an `AbstractDecoder` with `decode_chunk` (several tokens against the cache in one pass) | `Policy` | `generate_speculative`'s verification pass (other decoders are verified token by token) |

Everything is per sample: steps batch a plain `AbstractSequenceModel` with `jax.vmap`,
and the sampler vmaps `prefill` / `decode_step` over the rows of a batch. `key` is a
PRNG key for stochastic layers (dropout); `None` means deterministic.

A decoder keeps its own cache type (any pytree, usually an `eqx.Module`):

- `init_cache(cache_size)`: an empty cache with room for `cache_size` tokens;
- `prefill(tokens[P], mask[P], *, cache_size)`: run a (possibly padded) prompt and
  return the next-token logits `[V]` after its last real token and the filled cache;
- `decode_step(token[], cache, *, index, position)`: feed one token, stored at cache
  slot `index` with position `position` (the number of real tokens before it), and
  return the next-token logits `[V]` and the updated cache.

The sampler calls `prefill(..., cache_size=P + max_new_tokens)`, then `decode_step`
with `index = P + i` for the `i`-th new token. A minimal decoder is a few lines (see
`examples/custom_model.py`):

```python
class Bigram(AbstractDecoder[Int[Array, ""]]):   # the cache is the last token
    table: Float[Array, "V V"]
    vocab_size: int = eqx.field(static=True)

    def __call__(self, tokens, mask, *, key=None):
        return self.table[tokens]
    def init_cache(self, cache_size):
        return jnp.zeros((), jnp.int32)
    def prefill(self, tokens, mask, *, cache_size):
        last = tokens[jnp.max(jnp.where(mask, jnp.arange(tokens.shape[0]), 0))]
        return self.table[last], last
    def decode_step(self, token, cache, *, index, position):
        return self.table[token], token
```
"""  # noqa: E501 (markdown table rows cannot be wrapped)

import abc
from typing import Generic, TypeVar

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

Cache = TypeVar("Cache")


class AbstractSequenceModel(eqx.Module):
    """A per-sample sequence model: `model(tokens[T], mask[T], *, key=None) -> out[T, ...]`.

    `out[t]` depends only on the real tokens up to `t` for causal models (a policy's
    `[T, V]` next-token logits, a critic's `[T]` values). Steps batch it with
    `jax.vmap` unless it is also an `AbstractBatchedModel`.
    """

    @abc.abstractmethod
    def __call__(
        self,
        tokens: Int[Array, " T"],
        mask: Bool[Array, " T"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T ..."]:
        """One sequence's per-position outputs."""
        raise NotImplementedError


class AbstractBatchedModel(eqx.Module):
    """A model whose call also accepts a batch `[B, T]` directly.

    The result must equal `jax.vmap(model)(tokens, mask)` (with per-row keys when a key
    is given); the point is a faster implementation (flat 2-D matrix products). Combine
    it with `AbstractSequenceModel` or `AbstractScalarModel`.
    """

    @abc.abstractmethod
    def __call__(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "..."]:
        """Outputs for one sequence or a batch of them."""
        raise NotImplementedError


class AbstractScalarModel(eqx.Module):
    """A scalar-head model: one scalar per sequence (a reward model).

    `model(tokens[T], mask[T], *, key=None) -> Float[""]`.
    """

    @abc.abstractmethod
    def __call__(
        self,
        tokens: Int[Array, " T"],
        mask: Bool[Array, " T"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, ""]:
        """The sequence's scalar score."""
        raise NotImplementedError


class AbstractSelectiveLM(eqx.Module):
    """A language model that scores chosen tokens without materialising `[T, V]` logits.

    `model.selected_logprobs(tokens, mask, select, *, key=None) -> (logp, mean_logit)`,
    both `[..., T]`: `logp[t] = log p(tokens[t] | tokens[<t])` and `mean_logit[t]` the
    vocabulary mean of the logits that predicted token `t`, where `select & mask` holds
    (0 elsewhere); equal to the same quantities computed from the full logits. With
    `temperature=τ` they are those of `logits / τ`; with `with_entropy=True` a third
    output is the entropy of each predictive distribution (`entropy_from_logits`,
    no gradient). The DPO and GRPO steps use it when the policy (or reference) meets
    it, so the LM head runs only on completion positions.
    """

    @abc.abstractmethod
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
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[Float[Array, "*B T"], ...]:
        """Log-probabilities and mean logits (and entropies) of the selected tokens.

        With `segment_ids` / `branch_ids` the rows are shared-prefix packed
        (`rlhf_eqx.PackedPreferenceBatch`, `attention_layout`): a token is predicted
        from the last earlier position it may attend to. `regions` (static), when
        given, says that every row has the same region boundaries (prefix, then one
        region per branch); a model may use it to skip cross-branch work. A model that cannot run
        that layout raises `ValueError` when they are given; the DPO step then needs the unpacked
        `PreferenceBatch`.
        """
        raise NotImplementedError


class AbstractBranchScorer(eqx.Module):
    """A scalar-head model that scores shared-prefix packed rows.

    `model.branch_scores(tokens, mask, segment_ids, branch_ids, *, num_segments,
    num_branches=2, key=None) -> Float[*B, K, n]`: the score of each segment's prefix
    followed by each of its branches (`rlhf_eqx.PackedPreferenceBatch`), equal to the
    model's call on that sequence unpacked. The reward-model step uses it for packed
    batches.
    """

    @abc.abstractmethod
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
        """Per segment and branch, the score of prefix + branch (`regions`: see
        `AbstractSelectiveLM.selected_logprobs`)."""
        raise NotImplementedError


class AbstractDecoder(AbstractSequenceModel, Generic[Cache]):
    """An autoregressive model with a cache: what `generate` / `generate_batch` need.

    `Cache` is the decoder's own cache type (a pytree). See the module docstring for
    the contract of each method.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Size of the output distribution (ids are in `[0, vocab_size)`)."""
        raise NotImplementedError

    @abc.abstractmethod
    def init_cache(self, cache_size: int) -> Cache:
        """An empty cache with room for `cache_size` tokens."""
        raise NotImplementedError

    @abc.abstractmethod
    def prefill(
        self, tokens: Int[Array, " P"], mask: Bool[Array, " P"], *, cache_size: int
    ) -> tuple[Float[Array, " V"], Cache]:
        """Run a prompt: next-token logits after its last real token, and the cache."""
        raise NotImplementedError

    @abc.abstractmethod
    def decode_step(
        self,
        token: Int[Array, ""],
        cache: Cache,
        *,
        index: Int[Array, ""] | int,
        position: Int[Array, ""],
    ) -> tuple[Float[Array, " V"], Cache]:
        """Feed one token at slot `index`, position `position`: next logits and the cache."""
        raise NotImplementedError


class AbstractChunkDecoder(AbstractDecoder[Cache]):
    """A decoder that can also feed several tokens against its cache in one pass
    (`generate_speculative`'s verification pass; `Policy` is one).

    `decode_chunk(tokens[C], cache, *, index, position) -> (logits [C, V], cache)`:
    token `c` is stored at slot `index + c` with position `position + c` and attends to
    the real slots before `index` and to the chunk up to itself; `logits[c]` is the
    next-token distribution after it. The returned cache drops every slot from
    `index + C` on, so a chunk fed at `index` replaces whatever an earlier call had
    cached there (the rejected proposals of a speculative step). It equals `C` calls of
    `decode_step` on a cache with nothing after `index`.
    """

    @abc.abstractmethod
    def decode_chunk(
        self,
        tokens: Int[Array, " C"],
        cache: Cache,
        *,
        index: Int[Array, ""] | int,
        position: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "C V"], Cache]:
        """Feed `C` tokens at slots `index …`, positions `position …`: their next-token
        logits and the cache (slots after the chunk dropped)."""
        raise NotImplementedError
