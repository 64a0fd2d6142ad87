"""A paged KV cache: one pool of fixed-size pages shared by every sequence, a page table
per sequence, attention that gathers a sequence's pages, and the policy's decode step on
it (the layout of vLLM's PagedAttention, Kwon et al. 2023).

A sequence's cache is its real tokens only, in order: logical slot `i` holds the token at
position `i` (no padding), in page `page_table[i // page_size]` at offset
`i % page_size`. Pages are whole: several sequences may map the same physical page
(a shared prefix), and nothing in a page depends on which sequence reads it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._decode_attention import cached_attention
from ._heads import Policy


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
    return cached_attention(q, keys_t, values, allowed, scale=scale, cap=cap)


def paged_decode_step(
    policy: Policy,
    tokens: Int[Array, " B"],
    pages: PagedKVCache,
    page_tables: Int[Array, "B M"],
    *,
    index: Int[Array, " B"],
    store: Bool[Array, " B"] | None = None,
) -> tuple[Float[Array, "B V"], PagedKVCache]:
    """`Policy.decode_step` for `B` sequences sharing a paged cache: feed `tokens[b]` at
    logical slot (and rotary position) `index[b]` of the sequence whose pages are
    `page_tables[b]`.

    In each layer the fed tokens' keys and values are first stored in the pool, at
    `(page_tables[b, index[b] // page_size], index[b] % page_size)` (in place: the pool
    is carried through the layer scan), then each sequence's pages are gathered and its
    token attends to slots `0 … index[b]` (within the window on sliding-window layers;
    `paged_attention`). The transient memory is one layer of `B` sequences of
    `M · page_size` slots. Several sequences may share pages (a common prefix): a page
    written by a step must belong to that sequence alone.

    **Arguments:**

    - `policy`: a `Policy`.
    - `tokens`: the ids fed, `[B]`.
    - `pages`: the pool.
    - `page_tables`: each sequence's pages, `[B, M]` ids (entries past
      `index // page_size` may be unused, below 0).
    - `index`: each token's slot and position (its sequence's length before it).
    - `store`: which sequences store their token (default all); the others leave the
      pool as it is and their logits are meaningless (an idle or waiting sequence,
      whose page for `index` may not exist).

    **Returns:** the next-token logits `[B, V]` and the pool with the tokens stored.
    """
    tr = policy.transformer
    cfg = tr.cfg
    B = tokens.shape[0]
    index = jnp.asarray(index, jnp.int32)
    ps, Np = pages.page_size, pages.num_pages
    S = page_tables.shape[1] * ps
    slots = jnp.arange(S, dtype=jnp.int32)
    upto = (slots[None, :] <= index[:, None])[:, None, :]  # [B, 1, S]
    entry = jnp.clip(index // ps, 0, page_tables.shape[1] - 1)
    page = page_tables[jnp.arange(B), entry]
    if store is not None:
        page = jnp.where(store, page, Np)
    page = jnp.where(page >= 0, page, Np)  # dropped: no page, or not stored
    offset = index % ps
    attend_rows = jax.vmap(
        lambda q, pool, layer, table, ok: paged_attention(
            q, pool, layer, table, ok, scale=cfg.query_scale, cap=cfg.attn_softcap
        ),
        in_axes=(0, None, None, 0, 0),
    )

    def attend(q, k, v, kv, layer_idx, allowed):
        pk, pv = kv
        # k, v: [B, 1, K, hd]; stored as columns of the pool (index arrays at
        # separated axes: the update is [B, K, hd])
        pk = pk.at[layer_idx, :, :, page, offset].set(k[:, 0].astype(pk.dtype), mode="drop")
        pv = pv.at[layer_idx, :, page, offset, :].set(v[:, 0].astype(pv.dtype), mode="drop")
        pool = PagedKVCache(k=pk, v=pv)
        return attend_rows(q, pool, layer_idx, page_tables, allowed), (pk, pv)

    x, (pk, pv) = tr._cached_scan(
        tr._embed(tokens[:, None]),  # [B, 1, D]
        index[:, None],
        slots[None, :],
        upto,
        (pages.k, pages.v),
        attend,
    )
    return policy.logits_from_hidden(x[:, 0]), PagedKVCache(k=pk, v=pv)
