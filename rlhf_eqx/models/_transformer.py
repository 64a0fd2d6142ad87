"""The decoder: a stack of pre-norm blocks applied with `jax.lax.scan`.

The model is written for one sequence (no batch axis); batch it with `jax.vmap`.
Positions come from the mask (the `t`-th real token of a segment gets position
`t`), so left padding, right padding and padding between a prompt and its completion
all give the same outputs at real positions. Projections are fused (`wqkv`,
`w_gate_up`) and the KV cache is head-major (values `[L, K, S, hd]`, keys stored transposed
`[L, K, hd, S]`) and updated in place.

Per-layer differences (sliding window or global attention, local or global rotary
base) are data scanned with the weights — `window[l]` (0 for a global layer) and
`local[l]` — so a stack that alternates local and global layers still compiles one
layer body.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ._attention import attention, region_attention
from ._config import TransformerConfig
from ._decode_attention import cached_attention
from ._decoder_layer import LORA_TARGETS, DecoderLayer, gather_positions
from ._layers import AbstractQuantizedWeight, normal_init, rms_norm
from ._masks import attention_layout, within_window
from ._protocols import AbstractBatchedModel, AbstractSequenceModel
from ._rope import rope_tables

# queries (and keys) per tile of the causal blockwise attention over a whole sequence
# (`attention`); on CPU, 256 is faster than 128 on long rows (level on short ones) and
# than 512.
ATTENTION_BLOCK = 256


class KVCache(eqx.Module):
    """Per-sequence key/value cache, head-major: `v[l, h, s]` is layer `l`, kv head `h`,
    slot `s`; the keys are stored transposed, `k[l, h, :, s]`, so that a decode step's
    score product reads them without a transposition (`cached_attention`).

    `mask[s]` says whether slot `s` holds a real token that later tokens may attend to;
    `positions[s]` is that token's rotary position (for sliding-window layers).
    """

    k: Float[Array, "L K hd S"]
    v: Float[Array, "L K S hd"]
    mask: Bool[Array, " S"]
    positions: Int[Array, " S"]


def _layer_keys(key: PRNGKeyArray | None, n_layers: int):
    if key is None:
        return None
    return jax.random.split(key, (n_layers, len(LORA_TARGETS)))


def _per_layer(cfg: TransformerConfig) -> tuple[Int[Array, " L"], Bool[Array, " L"]]:
    """Per-layer scan data: the window (0 = global attention) and whether the layer is local."""
    local = np.array(cfg.local_layers, dtype=bool)
    window = np.where(local, cfg.sliding_window or 0, 0).astype(np.int32)
    return jnp.asarray(window), jnp.asarray(local)


def _rope(cfg: TransformerConfig, positions: Int[Array, "*B T"]):
    """Global and (Gemma 3) local rotary tables; the local ones are `None` when shared."""
    glob = rope_tables(positions, jnp.asarray(cfg.inv_freq()), cfg.rope_attention_factor())
    if cfg.rope_local_theta is None:
        return glob, None
    local = rope_tables(
        positions,
        jnp.asarray(cfg.inv_freq(local=True)),
        cfg.rope_attention_factor(local=True),
    )
    return glob, local


def _select(rope, local: Bool[Array, ""]):
    glob, loc = rope
    if loc is None:
        return glob
    return tuple(jnp.where(local, a, b) for a, b in zip(loc, glob))


class Transformer(AbstractSequenceModel, AbstractBatchedModel):
    """Token embedding, `n_layers` stacked `DecoderLayer`s (scanned), final RMSNorm.

    `__call__(tokens, mask)` returns the final hidden states `[T, D]`.

    `embed` is a dense `[V, D]` table or a frozen quantised weight of shape
    `(in, out) = (D, V)` (e.g. a `GGUFWeight` whose rows are the vocabulary, as GGUF's
    `token_embd.weight`): the lookup then decodes only the gathered rows
    (`AbstractQuantizedWeight.columns`), and a tied LM head multiplies by it without a
    dense copy (`matmul`).
    """

    embed: Float[Array, "V D"] | AbstractQuantizedWeight
    layers: DecoderLayer
    final_norm: Float[Array, " D"]
    cfg: TransformerConfig = eqx.field(static=True)

    def __init__(self, cfg: TransformerConfig, *, key: PRNGKeyArray):
        ke, kl = jax.random.split(key)
        self.cfg = cfg
        dt = cfg.param_dtype
        (self.embed,) = normal_init(
            ke, shapes=((cfg.vocab_size, cfg.d_model),), scales=(0.02,), dtype=dt
        )
        self.layers = DecoderLayer(cfg, key=kl, n_layers=cfg.n_layers)
        self.final_norm = jnp.full((cfg.d_model,), cfg.norm_init, dt)

    def dense_embed(self, dtype=None) -> Float[Array, "V D"]:
        """The embedding table as a dense `[V, D]` array (dequantised when quantised),
        in `dtype` (default: the parameter dtype)."""
        dtype = self.cfg.param_dtype if dtype is None else dtype
        if isinstance(self.embed, AbstractQuantizedWeight):
            return self.embed.dequantize(dtype).T
        return self.embed.astype(dtype)

    def _embed(self, tokens: Int[Array, "*B T"]) -> Float[Array, "*B T D"]:
        if isinstance(self.embed, AbstractQuantizedWeight):
            x = self.embed.columns(tokens, self.cfg.param_dtype)
        else:
            x = jnp.take(self.embed, tokens, axis=0)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(self.cfg.d_model**0.5, x.dtype)
        return x

    def _final(self, x):
        return rms_norm(x, self.final_norm, self.cfg.norm_eps, plus_one=self.cfg.norm_plus_one)

    def _scan(self, x, allowed, positions, key, collect_kv: bool, regions=None, at=None):
        cfg = self.cfg
        rope = _rope(cfg, positions)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        keys = _layer_keys(key, cfg.n_layers)
        windows, local = _per_layer(cfg)
        windowed = cfg.sliding_window is not None

        def body(x, xs, at=None):
            layer_dyn, lkeys, window, is_local = xs
            layer = eqx.combine(layer_dyn, static)
            ok = allowed & within_window(positions, positions, window) if windowed else allowed
            if at is not None:
                ok = gather_positions(ok, at)

            def attend(q, k, v):
                kh, vh = jnp.swapaxes(k, -3, -2), jnp.swapaxes(v, -3, -2)
                kw = dict(scale=cfg.query_scale, cap=cfg.attn_softcap)
                if at is not None:  # a few queries against every key
                    o = attention(q, kh, vh, ok, **kw)
                elif regions is None:
                    o = attention(q, kh, vh, ok, causal_block=ATTENTION_BLOCK, **kw)
                else:
                    o = region_attention(q, kh, vh, ok, regions, causal_block=ATTENTION_BLOCK, **kw)
                return o, ((kh, vh) if collect_kv else None)

            return layer.block(x, cfg, _select(rope, is_local), attend, lkeys, at=at)

        if cfg.remat == "dots":  # keep the products' outputs, recompute the rest
            body = jax.checkpoint(
                body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            )
        elif cfg.remat:
            body = jax.checkpoint(body)
        xs = (dynamic, keys, windows, local)
        if at is None:
            x, kv = jax.lax.scan(body, x, xs)
            return self._final(x), kv
        # every layer but the last at all positions; the last only where it is read
        first, last = jax.tree.map(lambda a: a[:-1], xs), jax.tree.map(lambda a: a[-1], xs)
        if cfg.n_layers > 1:
            x, _ = jax.lax.scan(body, x, first)
        x, _ = body(x, last, at)
        return self._final(x), None

    def __call__(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        *,
        segment_ids: Int[Array, "*B T"] | None = None,
        branch_ids: Int[Array, "*B T"] | None = None,
        regions: tuple[int, ...] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*B T D"]:
        """Hidden states for one sequence (or a batch: any leading axes, same result as `jax.vmap`).

        **Arguments:**

        - `tokens`, `mask`: token ids and which of them are real.
        - `segment_ids`: optional packing ids; tokens attend only within their segment
          and positions restart at 0 in each segment.
        - `branch_ids`: optional shared-prefix branches (0 for the shared prefix, `b > 0`
          for branch `b`): a branch token attends to the prefix and its own branch only,
          and its positions continue the prefix's (`attention_layout`). Packing a prompt
          once with both completions of a preference pair after it runs the prompt once
          instead of twice, with the same outputs at every position.
        - `regions`: with `branch_ids`, the boundaries shared by every row — a prefix of
          `regions[0]` positions, then one region per branch (`region_attention`): each
          branch is then scored only against the prefix and itself.
        - `key`: enables LoRA dropout when adapters are attached (training); `None`
          is deterministic.
        """
        allowed, positions = attention_layout(mask, segment_ids, branch_ids)
        h, _ = self._scan(
            self._embed(tokens), allowed, positions, key, collect_kv=False, regions=regions
        )
        return h

    def hidden_at(
        self,
        tokens: Int[Array, "*B T"],
        mask: Bool[Array, "*B T"],
        at: Int[Array, "*B N"],
        *,
        segment_ids: Int[Array, "*B T"] | None = None,
        branch_ids: Int[Array, "*B T"] | None = None,
        regions: tuple[int, ...] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*B N D"]:
        """The final hidden states at positions `at` only: `self(tokens, mask, ...)`
        gathered at `at` (`[..., N]` indices into `T`), computed with less work — every
        layer but the last runs on all positions, the last computes keys and values at
        all positions but its queries, output projection and MLP only at `at`.

        A reward model reads one position per sequence, so this skips nearly a whole
        layer (a quarter of a 4-layer model's forward and backward work). Arguments as
        for `__call__`; with LoRA dropout (`key`) the last layer draws its masks for the
        `N` positions only, so sampled masks differ from `__call__`'s.
        """
        allowed, positions = attention_layout(mask, segment_ids, branch_ids)
        h, _ = self._scan(
            self._embed(tokens), allowed, positions, key, collect_kv=False, regions=regions, at=at
        )
        return h

    def prefill(
        self, tokens: Int[Array, " P"], mask: Bool[Array, " P"], *, cache_size: int
    ) -> tuple[Float[Array, "P D"], KVCache]:
        """Run the prompt and return its hidden states and a cache with `cache_size` slots."""
        P = tokens.shape[0]
        if cache_size < P:
            raise ValueError(f"cache_size={cache_size} is smaller than the prompt length {P}")
        allowed, positions = attention_layout(mask, None)
        h, (k, v) = self._scan(self._embed(tokens), allowed, positions, None, collect_kv=True)
        pad = [(0, 0), (0, 0), (0, cache_size - P), (0, 0)]
        extra = cache_size - P
        cache = KVCache(
            k=jnp.swapaxes(jnp.pad(k, pad), -1, -2),
            v=jnp.pad(v, pad),
            mask=jnp.concatenate([mask, jnp.zeros((extra,), jnp.bool_)]),
            positions=jnp.concatenate([positions, jnp.zeros((extra,), jnp.int32)]),
        )
        return h, cache

    def decode_step(
        self,
        token: Int[Array, ""],
        cache: KVCache,
        *,
        index: Int[Array, ""] | int,
        position: Int[Array, ""],
    ) -> tuple[Float[Array, " D"], KVCache]:
        """Feed one token at cache slot `index` with rotary position `position`.

        The token attends to every valid slot (within the window on sliding-window
        layers) and to itself; its keys and values are written into the cache in place
        (`dynamic_update_slice` inside the layer scan).
        """
        index = jnp.asarray(index, jnp.int32)
        position = jnp.asarray(position, jnp.int32)
        slot_mask = cache.mask.at[index].set(True)
        slot_pos = cache.positions.at[index].set(position)
        x, cache = self._cached_layers(
            token[None], position[None], cache, index, slot_mask, slot_pos, slot_mask[None, :]
        )
        return x[0], cache

    def decode_chunk(
        self,
        tokens: Int[Array, " C"],
        cache: KVCache,
        *,
        index: Int[Array, ""] | int,
        position: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "C D"], KVCache]:
        """Feed `C` tokens at cache slots `index … index + C - 1`, rotary positions
        `position … position + C - 1`, in one pass (the verification pass of
        speculative decoding).

        Token `c` attends to the real slots before `index` (within the window on
        sliding-window layers) and to the chunk's tokens up to itself. The cache keeps
        the slots before `index`, holds the chunk in the next `C` slots, and drops the
        slots after them: feeding a chunk at `index` discards whatever was cached from
        `index` on (tokens proposed and rejected by an earlier pass). With `C = 1` on a
        cache with nothing after `index` this is `decode_step`; in general it equals
        `C` decode steps, and its hidden states equal the full forward pass's.
        `index + C` may not exceed the cache size.
        """
        C, S = tokens.shape[0], cache.mask.shape[0]
        index = jnp.asarray(index, jnp.int32)
        position = jnp.asarray(position, jnp.int32)
        slots = jnp.arange(S, dtype=jnp.int32)
        in_chunk = (slots >= index) & (slots < index + C)
        slot_mask = (cache.mask & (slots < index)) | in_chunk
        slot_pos = jnp.where(in_chunk, position + slots - index, cache.positions)
        # causal by slot: chunk token c sees the kept slots and the chunk up to itself
        causal = slot_mask[None, :] & (slots[None, :] <= index + jnp.arange(C)[:, None])
        pos = position + jnp.arange(C, dtype=jnp.int32)
        return self._cached_layers(tokens, pos, cache, index, slot_mask, slot_pos, causal)

    def _cached_layers(self, tokens, pos, cache, index, slot_mask, slot_pos, allowed):
        """The layers over `C` new tokens (rotary positions `pos`) against the cache:
        their keys and values written at slots `index …` of each layer's cache inside
        the layer scan, attention over the slots `allowed` (`[C, S]`, narrowed to the
        window on sliding-window layers); the final hidden states `[C, D]` and the
        cache with `slot_mask` / `slot_pos`."""
        cfg = self.cfg
        zero = jnp.zeros((), jnp.int32)

        def attend(q, k, v, kv, layer_idx, seen):
            kc, vc = kv
            # k, v: [C, K, hd]; the keys go in as columns of the transposed cache
            kc = jax.lax.dynamic_update_slice(
                kc, jnp.moveaxis(k, 0, -1)[None].astype(kc.dtype), (layer_idx, zero, zero, index)
            )
            vc = jax.lax.dynamic_update_slice(
                vc, jnp.swapaxes(v, 0, 1)[None].astype(vc.dtype), (layer_idx, zero, index, zero)
            )
            kw = dict(scale=cfg.query_scale, cap=cfg.attn_softcap)
            return cached_attention(q, kc[layer_idx], vc[layer_idx], seen, **kw), (kc, vc)

        x, (kc, vc) = self._cached_scan(
            self._embed(tokens), pos, slot_pos, allowed, (cache.k, cache.v), attend
        )
        return x, KVCache(k=kc, v=vc, mask=slot_mask, positions=slot_pos)

    def _cached_scan(self, x, query_pos, slot_pos, allowed, kv, attend):
        """The layers over the embedded new tokens `x` (rotary positions `query_pos`)
        against a cache `kv` (any pytree of arrays: the dense cache's or a page pool's
        keys and values), carried through the layer scan so that each layer writes its
        part in place: `attend(q, k, v, kv, layer, seen) -> (out, kv)` stores layer
        `layer`'s new keys and values and attends over the slots `seen` — `allowed`,
        narrowed on sliding-window layers to the keys within the window
        (`within_window(query_pos, slot_pos, window)`). Returns the final hidden states
        and the cache. Shared by `decode_step`, `decode_chunk` and `paged_decode_step`."""
        cfg = self.cfg
        rope = _rope(cfg, query_pos)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        windows, local = _per_layer(cfg)
        windowed = cfg.sliding_window is not None

        def body(carry, xs):
            x, kv = carry
            layer_dyn, layer_idx, window, is_local = xs
            layer = eqx.combine(layer_dyn, static)
            seen = allowed & within_window(query_pos, slot_pos, window) if windowed else allowed
            attend_layer = lambda q, k, v: attend(q, k, v, kv, layer_idx, seen)
            x, kv = layer.block(x, cfg, _select(rope, is_local), attend_layer)
            return (x, kv), None

        layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
        (x, kv), _ = jax.lax.scan(body, (x, kv), (dynamic, layer_ids, windows, local))
        return self._final(x), kv


def with_remat(model: PyTree, remat: bool | str) -> PyTree:
    """`model` with every `Transformer` in it set to recompute `remat` of each layer in
    the backward pass (`TransformerConfig.remat`: `False`, `True` / `"full"` or
    `"dots"`), e.g. a loaded checkpoint trained with less activation memory:
    `policy = rx.with_remat(rx.load_gguf(path)[0], "dots")`.

    Values and gradients are unchanged (up to float reassociation in the recomputed
    parts); only what the backward pass keeps and recomputes differs. The arrays are
    shared with `model`, not copied. The mode is part of the model's pytree structure
    (its `cfg` is a static field): build filter specs (`lora_filter`), train states and
    steps from the returned model, not from `model`.

    **Arguments:**

    - `model`: any pytree holding `Transformer`s (a `Policy`, `ValueModel`,
      `RewardModel`, a `Transformer`, or a container of them).
    - `remat`: the `TransformerConfig.remat` to set; another value is a `ValueError`
      naming it.

    **Returns:** the same pytree, each `Transformer`'s `cfg` with `remat` replaced.
    """

    def swap(x):
        if not isinstance(x, Transformer):
            return x
        new = object.__new__(Transformer)  # the fields as they are; only `cfg` differs
        for field in dataclasses.fields(x):
            object.__setattr__(new, field.name, getattr(x, field.name))
        object.__setattr__(new, "cfg", dataclasses.replace(x.cfg, remat=remat))
        return new

    return jax.tree_util.tree_map(swap, model, is_leaf=lambda x: isinstance(x, Transformer))
