"""A paged KV cache: one pool of fixed-size pages shared by every sequence, a page table
per sequence, attention that gathers a sequence's pages, and the policy's decode step on
it (the layout of vLLM's PagedAttention, Kwon et al. 2023).

A sequence's cache is its real tokens only, in order: logical slot `i` holds the token at
position `i` (no padding), in page `page_table[i // page_size]` at offset
`i % page_size`. Pages are whole: several sequences may map the same physical page
(a shared prefix), and nothing in a page depends on which sequence reads it.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._decode_attention import cached_attention
from ._heads import Policy
from ._masks import within_window
from ._transformer import _per_layer, _rope, _select


class PagedKVCache(eqx.Module):
    """A pool of `num_pages` KV-cache pages of `page_size` tokens, head-major like
    `KVCache`: `v[l, h, p, o]` is layer `l`, kv head `h`, page `p`, offset `o`; keys are
    stored transposed, `k[l, h, :, p, o]`, so that the pages of a sequence gathered in
    page-table order are the `[K, hd, S]` keys a decode step's score product reads
    (`cached_attention`) with no transposition.

    The pool holds no masks or positions: which slots of a page are real, and their
    positions, follow from the sequence's length (slot `i` is position `i`).
    """

    k: Float[Array, "L K hd Np ps"]
    v: Float[Array, "L K Np ps hd"]

    @staticmethod
    def empty(policy: Policy, num_pages: int, page_size: int) -> "PagedKVCache":
        """A zeroed pool for `policy` (its layers, kv heads, head size and parameter dtype).

        **Arguments:**

        - `policy`: the `Policy` whose keys and values the pool will hold.
        - `num_pages`: pages in the pool (a positive int).
        - `page_size`: tokens per page (a positive int).
        """
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(
                    f"PagedKVCache.empty: {name} must be a positive int, got {value!r}"
                )
        cfg = policy.cfg
        L, K, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        dt = cfg.param_dtype
        return PagedKVCache(
            k=jnp.zeros((L, K, hd, num_pages, page_size), dt),
            v=jnp.zeros((L, K, num_pages, page_size, hd), dt),
        )

    @property
    def num_pages(self) -> int:
        return self.v.shape[-3]

    @property
    def page_size(self) -> int:
        return self.v.shape[-2]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (its keys and values in every layer)."""
        L, K, _, ps, hd = self.v.shape
        return 2 * L * K * ps * hd * jnp.dtype(self.v.dtype).itemsize

    def write(
        self,
        k: Float[Array, "L K hd n"],
        v: Float[Array, "L K n hd"],
        page: Int[Array, " n"],
        offset: Int[Array, " n"],
    ) -> "PagedKVCache":
        """The pool with `n` key/value columns written at `(page[j], offset[j])`.

        Columns whose `page` lies outside `[0, num_pages)` are dropped (a masked write:
        pass `num_pages` for a column that must not be stored). `k` / `v` are a
        `KVCache`'s layout without the sequence axis's meaning: column `j` of every layer.
        """
        return PagedKVCache(
            k=self.k.at[:, :, :, page, offset].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, :, page, offset, :].set(v.astype(self.v.dtype), mode="drop"),
        )


def gather_pages(
    pages: PagedKVCache, layer: Int[Array, ""] | int, page_table: Int[Array, " M"]
) -> tuple[Float[Array, "K hd S"], Float[Array, "K S hd"]]:
    """Layer `layer`'s keys (transposed) and values of a sequence, `S = M · page_size`
    slots in page-table order, read straight from the pool (one gather of the `M` pages,
    no copy of the layer). Entries below 0 (unused) read page 0: their slots must be
    masked by the caller."""
    L, K, hd, _, ps = pages.k.shape
    table = jnp.maximum(page_table, 0)
    layer = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), table.shape)
    idx = jnp.stack([layer, table], axis=-1)  # [M, 2]: (layer, page) of each entry
    clip = jax.lax.GatherScatterMode.CLIP
    # gathered straight into [K, hd, M, ps] and [K, M, ps, hd] (no transposition)
    dn_k = jax.lax.GatherDimensionNumbers(
        offset_dims=(0, 1, 3), collapsed_slice_dims=(0, 3), start_index_map=(0, 3)
    )
    keys_t = jax.lax.gather(pages.k, idx, dn_k, (1, K, hd, 1, ps), mode=clip)
    dn_v = jax.lax.GatherDimensionNumbers(
        offset_dims=(0, 2, 3), collapsed_slice_dims=(0, 2), start_index_map=(0, 2)
    )
    values = jax.lax.gather(pages.v, idx, dn_v, (1, K, 1, ps, hd), mode=clip)
    keys_t, values = keys_t.reshape(K, hd, -1), values.reshape(K, -1, hd)
    return keys_t, values


def paged_attention(
    q: Float[Array, "T H hd"],
    pages: PagedKVCache,
    layer: Int[Array, ""] | int,
    page_table: Int[Array, " M"],
    allowed: Bool[Array, "T S"],
    *,
    k_new: Float[Array, "N K hd"] | None = None,
    v_new: Float[Array, "N K hd"] | None = None,
    new_at: Int[Array, ""] | int = 0,
    scale: float | None = None,
    cap: float | None = None,
) -> Float[Array, "T H hd"]:
    """Grouped-query attention of a few queries against one sequence's pages of a pool
    (layer `layer`), and optionally against `N` new keys and values not yet in the pool
    (the tokens being fed, at their own slots).

    The pages in `page_table` are gathered into `S = M · page_size` slots in table
    order (`gather_pages`, a masked gather: `allowed[t, s]` says whether query `t` sees
    slot `s`; table entries below 0 are unused and must be masked), the new columns
    replace slots `new_at … new_at + N - 1` of that copy (the pool is not written), and
    `cached_attention` runs on the result. Equal to
    `attention(q, k, v, allowed)` on the keys and values laid out densely, up to float32
    rounding. Rows with no allowed key get zeros.

    **Arguments:**

    - `q`: queries `[T, H, hd]` (after rotary embedding), `H` a multiple of `K`.
    - `pages`: the pool (`PagedKVCache`); `layer`: which of its layers.
    - `page_table`: the sequence's pages, `[M]` ids.
    - `allowed`: `[T, M · page_size]`, which slots each query attends to.
    - `k_new`, `v_new`: optional `[N, K, hd]` keys and values of slots `new_at …
      new_at + N - 1` (both or neither; `allowed` says who sees them).
    - `new_at`: their first slot.
    - `scale`, `cap`: as in `attention` (`hd ** -0.5` by default; no soft-capping).

    **Returns:** the attention output `[T, H, hd]`.
    """
    keys_t, values = gather_pages(pages, layer, page_table)
    if (k_new is None) != (v_new is None):
        raise ValueError("paged_attention: give k_new and v_new together, or neither")
    if k_new is not None:
        at = jnp.asarray(new_at, jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        k_cols = jnp.moveaxis(k_new, 0, -1).astype(keys_t.dtype)
        keys_t = jax.lax.dynamic_update_slice(keys_t, k_cols, (zero, zero, at))
        v_rows = jnp.swapaxes(v_new, 0, 1).astype(values.dtype)
        values = jax.lax.dynamic_update_slice(values, v_rows, (zero, at, zero))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return cached_attention(q, keys_t, values, allowed, scale=scale, cap=cap)


def paged_decode_step(
    policy: Policy,
    token: Int[Array, ""],
    pages: PagedKVCache,
    page_table: Int[Array, " M"],
    *,
    index: Int[Array, ""] | int,
) -> tuple[Float[Array, " V"], Float[Array, "L K hd"], Float[Array, "L K hd"]]:
    """`Policy.decode_step` on a paged cache: feed `token` at logical slot (and rotary
    position) `index` of the sequence whose pages are `page_table`.

    The token attends to slots `0 … index - 1` of the sequence's pages (within the
    window on sliding-window layers) and to itself; in each layer the sequence's pages
    are gathered (`paged_attention`), so the work and the transient memory are those of
    one layer of one sequence of `M · page_size` slots. The pool is read, not written:
    the token's keys and values are returned, for the caller to store at
    `(page_table[index // page_size], index % page_size)` with `PagedKVCache.write`
    (the caller owns the pool, which many sequences share; under `jax.vmap` over
    sequences the pool is passed unbatched).

    **Arguments:**

    - `policy`: a `Policy`.
    - `token`: the id fed.
    - `pages`: the pool.
    - `page_table`: the sequence's pages, `[M]` ids (entries at and past
      `index // page_size + 1` may be unused, below 0).
    - `index`: the slot and position of `token` (the sequence's length before it).

    **Returns:** the next-token logits `[V]` and the token's keys `[L, K, hd]` and values
    `[L, K, hd]` in every layer.
    """
    tr = policy.transformer
    cfg = tr.cfg
    index = jnp.asarray(index, jnp.int32)
    x = tr._embed(token[None])
    rope = _rope(cfg, index[None])
    S = page_table.shape[0] * pages.page_size
    slots = jnp.arange(S, dtype=jnp.int32)
    upto = (slots <= index)[None, :]
    dynamic, static = eqx.partition(tr.layers, eqx.is_array)
    windows, local = _per_layer(cfg)
    windowed = cfg.sliding_window is not None

    def body(x, xs):
        layer_dyn, layer_idx, window, is_local = xs
        layer = eqx.combine(layer_dyn, static)
        allowed = upto & within_window(index[None], slots, window) if windowed else upto

        def attend(q, k, v):
            o = paged_attention(
                q, pages, layer_idx, page_table, allowed, k_new=k, v_new=v, new_at=index,
                scale=cfg.query_scale, cap=cfg.attn_softcap,
            )  # fmt: skip
            return o, (k[0], v[0])

        x, kv = layer.block(x, cfg, _select(rope, is_local), attend)
        return x, kv

    layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    x, (k, v) = jax.lax.scan(body, x, (dynamic, layer_ids, windows, local))
    return policy.logits_from_hidden(tr._final(x)[0]), k, v
