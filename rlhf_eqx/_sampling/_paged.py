"""Continuous batching on a paged, prefix-shared KV cache.

`generate_continuous` gives each slot a cache region of the longest row (`P +
max_new_tokens` entries), so its memory is slots × that length whatever the rows hold.
Here the slots share one pool of pages (`rlhf_eqx.models.PagedKVCache`): a row holds a
page table of page ids, gets a page when its length crosses a page boundary, and gives
its pages back when it stops. Rows whose prompts share real tokens up to the end of a
page map that page to one physical page (reference-counted), found on the host before
the loop (`_paged_plan`). Scheduling, sampling and stopping are `generate_continuous`'s,
so each row's tokens are the same.
"""

import dataclasses
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, Key, UInt32

from ..models import AbstractDecoder, PagedKVCache, Policy, paged_decode_step
from ._continuous import (
    _admitted,
    _continuous_arguments,
    _is_int,
    _Plan,
    _prefill,
    _row_keys,
    _sample_slots,
    _slot_sampler,
    _SlotState,
    _staged,
    _start,
    _stops,
)
from ._decode import _int32_prompts, _with_prompts
from ._options import DEFAULT_TEMPERATURE, Count, GenerationOutput, Number
from ._paged_plan import check_pool, plan_pages


class PagedCacheStats(eqx.Module):
    """What a paged run held: the pool's size and its use.

    - `peak_pages`: the most pages in use at once (prompt pages shared by several rows
      count once); `peak_bytes = peak_pages · page_bytes`.
    - `pages_in_use`: pages still held when the loop ended (0: every page came back).
    - `pages_shared`: page references served by a page already in the pool (a shared
      prefix page mapped again instead of allocated and written).
    - `stalls`: decode steps a row waited for a page (0 when the pool has room for every
      row's worst case).
    - `num_pages`, `page_size`, `page_bytes`: the pool (bytes of one page, keys and
      values of every layer).
    - `dense_bytes`: what `generate_continuous`'s dense layout holds for the same run
      (`slots · (P + max_new_tokens)` tokens).
    """

    peak_pages: Int[Array, ""]
    pages_in_use: Int[Array, ""]
    pages_shared: Int[Array, ""]
    stalls: Int[Array, ""]
    num_pages: int = eqx.field(static=True)
    page_size: int = eqx.field(static=True)
    page_bytes: int = eqx.field(static=True)
    dense_bytes: int = eqx.field(static=True)

    @property
    def peak_bytes(self) -> Int[Array, ""]:
        return self.peak_pages * self.page_bytes


class _PagedPlan(eqx.Module):
    """Static settings: the continuous plan and the pool's shape."""

    base: _Plan
    page_size: int
    num_pages: int
    max_pages: int
    prefix_ids: int


class _Pool(eqx.Module):
    """The paged loop's cache (its `_SlotState.cache`, where the dense loop keeps the
    slots' cache regions): the pool of pages and its bookkeeping. `S` slots, `M`
    page-table entries a slot, `Np` pages, `U` shared-page ids."""

    pages: PagedKVCache
    free: Bool[Array, " Np"]
    page_table: Int[Array, "S M"]  # -1: unused
    need: Int[Array, " S"]  # pages a slot may still take (its budget's worst case)
    own: Int[Array, " S"]  # pages a slot holds alone (shared prompt pages not counted)
    prefix_page: Int[Array, " U"]  # physical page of a shared-page id, -1 when not held
    prefix_refs: Int[Array, " U"]
    in_use: Int[Array, ""]
    peak: Int[Array, ""]
    shared: Int[Array, ""]
    stalls: Int[Array, ""]
    stuck: Bool[Array, ""]


def _generate_paged(
    policy: Policy,
    prompts: Int[Array, "R P"],
    prompt_masks: Bool[Array, "R P"],
    keys: Key[Array, " R"],
    budgets: Int[Array, " B"],
    prefix_key: Int[Array, "R M"],
    canon: Int[Array, " R"],
    plan: _PagedPlan,
):
    opts = plan.base.opts
    R, P = prompts.shape
    G = opts.num_samples
    B = R * G
    S, Q = plan.base.slots, plan.base.prefill_rows
    ps, Np, M, U = plan.page_size, plan.num_pages, plan.max_pages, plan.prefix_ids
    prompts = _int32_prompts(policy, prompts, opts, "prompts: ids outside [0, vocab_size)")
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    zero = i32(0)
    cdiv = lambda a, b: (a + b - 1) // b

    prefill, one = _prefill(policy, prompts, prompt_masks, P)
    sample = _slot_sampler(opts, None)
    row_keys = _row_keys(keys, G)
    n_real = jnp.sum(prompt_masks, axis=-1, dtype=jnp.int32)
    stops = _stops(opts, plan.base.stop_sequences)
    entries = jnp.arange(M, dtype=jnp.int32)

    # The carry is the dense loop's `_SlotState` with a `_Pool` as its cache; a slot's
    # `slot_position` is also its length: the next token's slot.

    def demand(s: _SlotState, row):
        """Row `row`'s prompt pages: which are shared ids already held, which need a
        fresh page now, and how many more pages its budget may still need."""
        p = row // G
        n = n_real[p]
        u = prefix_key[p]
        is_prefix = entries < n // ps
        held = is_prefix & (s.cache.prefix_page[jnp.maximum(u, 0)] >= 0)
        partial = (entries == n // ps) & (n % ps != 0)
        fresh = (is_prefix & ~held) | partial
        later = cdiv(n + budgets[row] - 1, ps) - cdiv(n, ps)
        return p, n, u, is_prefix, held, fresh, later

    def safe(free, need, own, row, active):
        """Whether the rows in flight can all finish in age order (the banker's rule,
        Dijkstra 1965): each row's remaining worst case fits in the free pages plus the
        pages the older rows hold alone (returned when they stop). Rows are admitted in
        order, so a row's age is its output row. `free`, `need` may carry a leading
        axis of alternatives."""
        lead = (1,) * (need.ndim - 1)  # the alternatives' axis, if any
        older = active[None, :] & (row[None, :] < row[:, None])  # [i, j]: j older than i
        older = older.reshape(lead + older.shape)
        older_own = jnp.sum(jnp.where(older, own[..., None, :], 0), axis=-1)
        ok = ~active.reshape(lead + active.shape) | (need <= free[..., None] + older_own)
        return jnp.all(ok, axis=-1) & (free >= 0)

    def fits(s: _SlotState, row):
        _, n, _, _, _, fresh, later = demand(s, row)
        slot = jnp.argmax(s.slot_row < 0)
        return safe(
            Np - s.cache.in_use - jnp.sum(fresh, dtype=jnp.int32),
            s.cache.need.at[slot].set(later),
            s.cache.own.at[slot].set(i32(n % ps != 0)),
            s.slot_row.at[slot].set(row),
            s.slot_row.at[slot].set(row) >= 0,
        )

    def waiting(s: _SlotState):
        row = jnp.minimum(s.next_row, B - 1)
        return (s.next_row < B) & jnp.any(s.slot_row < 0) & fits(s, row)

    def admit(s: _SlotState) -> _SlotState:
        """Put the next row into the first free slot: map its held prompt pages, take
        fresh ones for the rest, write its prompt's keys and values there (from the
        staged prefill of the first prompt with its real tokens)."""
        pool = s.cache
        slot = i32(jnp.argmax(s.slot_row < 0))
        row = s.next_row
        p, n, u, is_prefix, held, fresh, later = demand(s, row)
        c = canon[p]
        restage = (c < s.staged_first) | (c >= s.staged_first + Q)
        staged, at = _staged(s, c, restage, prefill, prompts, prompt_masks, Q)
        # fresh pages: the first free ones, in order
        cand = jnp.nonzero(pool.free, size=M, fill_value=Np)[0].astype(jnp.int32)
        rank = jnp.cumsum(fresh, dtype=jnp.int32) - 1
        new = jnp.where(fresh, cand[jnp.maximum(rank, 0)], Np)
        uid = jnp.where(is_prefix, u, 0)
        row_table = jnp.where(held, pool.prefix_page[uid], jnp.where(fresh, new, -1))
        prefix_page = pool.prefix_page.at[jnp.where(is_prefix & ~held, u, U)].set(new, mode="drop")
        prefix_refs = pool.prefix_refs.at[jnp.where(is_prefix, u, U)].add(1, mode="drop")
        # the prompt's real tokens in order: the k-th one goes to slot k
        mask = prompt_masks[c]
        k = jnp.cumsum(mask, dtype=jnp.int32) - 1
        page = jnp.minimum(k // ps, M - 1)
        dest = jnp.where(mask & fresh[page], row_table[page], Np)
        cache = jax.tree.map(at, staged[2])
        in_use = pool.in_use + jnp.sum(fresh, dtype=jnp.int32)
        prompt = (prompts[p], prompt_masks[p])
        return _admitted(
            s,
            slot,
            n,
            s.logits.at[slot].set(at(staged[1])),
            dataclasses.replace(
                pool,
                pages=pool.pages.write(cache.k, cache.v, dest, k % ps),
                free=pool.free.at[new].set(False, mode="drop"),
                page_table=pool.page_table.at[slot].set(row_table),
                need=pool.need.at[slot].set(later),
                own=pool.own.at[slot].set(i32(n % ps != 0)),
                prefix_page=prefix_page,
                prefix_refs=prefix_refs,
                in_use=in_use,
                peak=jnp.maximum(pool.peak, in_use),
                shared=pool.shared + jnp.sum(held, dtype=jnp.int32),
            ),
            staged,
            prompt,
        )

    def cond(s: _SlotState):
        return ((s.next_row < B) | jnp.any(s.slot_row >= 0)) & ~s.cache.stuck

    def body(s: _SlotState) -> _SlotState:
        s = jax.lax.while_loop(waiting, admit, s)
        pool = s.cache
        active, row, step, tok, lp, recent, stop = _sample_slots(
            s, sample, row_keys, budgets, stops
        )
        going = active & ~stop

        # a row feeding the first token of a page needs a fresh one: the oldest rows
        # that need one get it as long as the state stays safe; the others wait (this
        # step is replayed for them: same key, same token)
        index = s.slot_position
        entry = jnp.minimum(index // ps, M - 1)
        want = going & (index % ps == 0)
        rank = jnp.sum(want[None, :] & (s.slot_row[None, :] < s.slot_row[:, None]), axis=1)
        grants = want[None, :] & (rank[None, :] < jnp.arange(S + 1)[:, None])  # [k, S]
        g = grants.astype(jnp.int32)
        ok = safe(
            Np - pool.in_use - jnp.sum(g, axis=1),
            jnp.where(going, pool.need, 0)[None, :] - g,
            pool.own[None, :] + g,
            s.slot_row,
            active,
        )
        k = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)), dtype=jnp.int32) - 1
        granted = want & (rank < k)
        stalled = want & ~granted
        going, emit = going & ~stalled, active & ~stalled
        cand = jnp.nonzero(pool.free, size=S, fill_value=Np)[0].astype(jnp.int32)
        rank_g = jnp.maximum(jnp.cumsum(granted, dtype=jnp.int32) - 1, 0)
        new = jnp.where(granted, cand[rank_g], Np)
        slots = jnp.arange(S)
        page_table = pool.page_table.at[slots, jnp.where(granted, entry, M)].set(new, mode="drop")
        free = pool.free.at[new].set(False, mode="drop")
        grew = granted.astype(jnp.int32)
        in_use = pool.in_use + jnp.sum(grew)
        peak = jnp.maximum(pool.peak, in_use)

        def advance(args):
            _, pages = args
            return paged_decode_step(policy, tok, pages, page_table, index=index, store=going)

        logits, pages = jax.lax.cond(
            jnp.any(going), advance, lambda args: args, (s.logits, pool.pages)
        )
        logits = jnp.where(stalled[:, None], s.logits, logits)
        out_row = jnp.where(emit, s.slot_row, B)
        write = lambda buf, x: buf.at[out_row, step].set(x, mode="drop")

        # stopped rows give their pages back; a shared page when its last row stops
        done = active & stop
        n = n_real[row // G]
        is_prefix = entries[None, :] < (n // ps)[:, None]
        u = prefix_key[row // G]
        prefix_refs = pool.prefix_refs.at[jnp.where(done[:, None] & is_prefix, u, U)].add(
            -1, mode="drop"
        )
        gone = (prefix_refs == 0) & (pool.prefix_page >= 0)
        own = done[:, None] & ~is_prefix & (page_table >= 0)
        free = free.at[jnp.where(own, page_table, Np)].set(True, mode="drop")
        free = free.at[jnp.where(gone, pool.prefix_page, Np)].set(True, mode="drop")
        in_use = in_use - jnp.sum(own, dtype=jnp.int32) - jnp.sum(gone, dtype=jnp.int32)
        moved = emit.astype(jnp.int32)
        return dataclasses.replace(
            s,
            slot_row=jnp.where(going | stalled, s.slot_row, -1),
            slot_step=step + moved,
            slot_position=s.slot_position + moved,
            logits=logits,
            cache=dataclasses.replace(
                pool,
                pages=pages,
                free=free,
                page_table=jnp.where(done[:, None], -1, page_table),
                need=jnp.where(done, 0, pool.need - grew),
                own=jnp.where(done, 0, pool.own + grew),
                prefix_page=jnp.where(gone, -1, pool.prefix_page),
                prefix_refs=prefix_refs,
                in_use=in_use,
                peak=peak,
                stalls=pool.stalls + jnp.sum(stalled, dtype=jnp.int32),
                # never (the oldest row can always go on); ends the loop if it did happen
                stuck=~jnp.any(emit),
            ),
            recent=jnp.where(stalled[:, None], s.recent, recent),
            out=s.out.written(write, tok, lp, active),
            seen=None if s.seen is None else s.seen.after(tok, emit),
        )

    pool = _Pool(
        pages=PagedKVCache.empty(policy, Np, ps),
        free=jnp.ones((Np,), jnp.bool_),
        page_table=jnp.full((S, M), -1, jnp.int32),
        need=jnp.zeros((S,), jnp.int32),
        own=jnp.zeros((S,), jnp.int32),
        prefix_page=jnp.full((U,), -1, jnp.int32),
        prefix_refs=jnp.zeros((U,), jnp.int32),
        in_use=zero,
        peak=zero,
        shared=zero,
        stalls=zero,
        stuck=jnp.zeros((), jnp.bool_),
    )
    init = _SlotState(
        logits=jnp.zeros((S, policy.vocab_size), jnp.float32),
        cache=pool,
        **_start(plan.base, B, one, stops[-1], opts.penalized),
    )
    s = jax.lax.while_loop(cond, body, init)
    pool = s.cache
    tokens = eqx.error_if(s.out.tokens, pool.stuck, "generate_paged: no row could go on")
    rep = lambda x: jnp.repeat(x, G, axis=0)
    out = _with_prompts(rep(prompts), rep(prompt_masks), dataclasses.replace(s.out, tokens=tokens))
    return out, pool.peak, pool.in_use, pool.shared, pool.stalls


_generate_paged_jit = eqx.filter_jit(_generate_paged)


# The keyword-only signature repeats `generate_continuous`'s on purpose (its cache="paged"
# calls this function); the checks behind both are one function (`_continuous_arguments`).
def generate_paged(
    policy: AbstractDecoder,
    prompts: Integer[ArrayLike, "R P"],
    prompt_masks: Bool[ArrayLike, "R P"] | Integer[ArrayLike, "R P"],
    keys: Key[Array, " R"] | UInt32[Array, "R 2"],
    *,
    slots: Count,
    max_new_tokens: Count,
    page_size: Count = 16,
    num_pages: Count | None = None,
    budgets: Int[Array | np.ndarray, " B"] | Sequence[int] | None = None,
    temperature: Number = DEFAULT_TEMPERATURE,
    top_k: Count | None = None,
    top_p: Number | None = None,
    min_p: Number | None = None,
    repetition_penalty: Number = 1.0,
    presence_penalty: Number = 0.0,
    frequency_penalty: Number = 0.0,
    eos_id: Count | Sequence[Count] | Int[np.ndarray, " S"] | None = None,
    stop_sequences: Sequence[Sequence[int]] | None = None,
    pad_id: Count = 0,
    num_samples: Count = 1,
    check_ids: bool = False,
    prefill_rows: Count | None = None,
) -> tuple[GenerationOutput, PagedCacheStats]:
    """`generate_continuous` on a paged, prefix-shared KV cache: the same rows, with cache
    memory that follows the tokens held instead of `slots · (P + max_new_tokens)`.

    **Layout.** The slots share one pool of `num_pages` pages of `page_size` tokens
    (`rlhf_eqx.models.PagedKVCache`) and each holds a page table (`[slots, M]` page ids,
    `M = ceil((P + max_new_tokens) / page_size)`). A row's cache is its prompt's real
    tokens followed by its fed tokens, slot `i` at position `i` (no padding is stored).
    A decode step gathers each row's pages, layer by layer (`paged_attention`, a masked
    gather with static shapes), and writes the fed token's keys and values into its page;
    a row takes a fresh page when its length reaches a page boundary and gives its pages
    back when it stops (a free mask in the loop's carry).

    **Prefix sharing.** Before the loop, the prompts are compared on the host at page
    granularity: a full page of a prompt's real tokens is shared by every row whose real
    tokens agree up to the end of that page — a group's `num_samples` rows, repeated
    prompts, a common system prompt (of any length of left padding), earlier turns of
    an episode. Shared pages are written once, by the first row that needs them, and
    reference-counted: freed when their last row stops. A prompt's last, partial page
    is never shared: each row gets its own copy at admission (it is written into next),
    so no page is written while shared. Prompts with identical real tokens are prefilled
    once (the first of them); prompts that share only a prefix are each prefilled whole
    and share the prefix's memory, not its prefill.

    **Admission rule.** Requests are admitted in order, and pages are taken only when a
    row reaches them, so the memory in use follows the tokens held. What keeps the pool
    from deadlocking is the banker's rule (Dijkstra 1965), with a row's worst case its
    budget (`ceil((n + budget - 1) / page_size)` pages for an `n`-token prompt, the fed
    tokens being all but the last sampled one): the state is safe when the rows in
    flight, taken oldest first, can each finish with the free pages plus the pages the
    older ones hold alone (shared prompt pages are not counted, they may outlive their
    row). The next request enters a free slot only when its prompt pages are free and
    the state with it admitted is safe. A row reaching a page boundary gets a fresh
    page when the state stays safe, the oldest rows first; otherwise it waits a step
    (its step is replayed: same key, same token), counted in `PagedCacheStats.stalls`.
    The oldest row can always go on, so the loop always ends. A request whose worst case
    exceeds the whole pool is refused up front. With a pool that holds every slot's worst
    case (the default) nothing ever waits; rows' `budgets` make the worst cases tight.

    **Outputs.** Scheduling, keys and sampling are `generate_continuous`'s: each row's
    tokens and log-probs equal the dense sampler's for the same keys (and, greedy,
    `generate_batch`'s), up to float32 rounding of the attention sums, which are laid out
    differently, whatever `slots`, `page_size`, `num_pages` and the sharing. One compile per shapes
    and settings (the sharing plan is data).

    **Arguments:** as `generate_continuous` (`policy` must be a `rlhf_eqx.Policy`; the
    prompts and their masks, JAX or NumPy arrays with integer ids and bool or 0 / 1
    integer masks, must be concrete: the sharing plan is made on the host), and

    - `page_size`: tokens per page (a positive int).
    - `num_pages`: pages in the pool; default `slots · M`, the dense layout's room.

    **Returns:** the `GenerationOutput` (as `generate_continuous`) and a
    `PagedCacheStats` (peak pages in use, pages shared, steps waited for a page, pages
    still held at the end: 0).

    Raises `ValueError` in one line naming the argument for a bad `page_size` or
    `num_pages`, a pool too small for the largest request alone, traced prompts, and
    everything `generate_continuous` refuses; `TypeError` for a decoder that is not a
    `Policy`.
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            "generate_paged (cache='paged') needs a rlhf_eqx.Policy (its paged decode step, "
            f"rlhf_eqx.models.paged_decode_step), got {type(policy).__name__}"
        )
    if isinstance(prompts, jax.core.Tracer) or isinstance(prompt_masks, jax.core.Tracer):
        raise ValueError(
            "generate_paged: prompts and prompt_masks must be concrete (the shared prefixes "
            "are planned on the host); call it outside jax.jit"
        )
    policy, prompts, prompt_masks, keys, budgets, base = _continuous_arguments(
        policy, prompts, prompt_masks, keys, slots=slots, max_new_tokens=max_new_tokens,
        budgets=budgets, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, eos_id=eos_id, stop_sequences=stop_sequences,
        pad_id=pad_id, num_samples=num_samples, check_ids=check_ids, prefill_rows=prefill_rows,
    )  # fmt: skip
    num_samples, max_new_tokens = base.opts.num_samples, base.opts.max_new_tokens  # Python ints
    if not (_is_int(page_size) and page_size >= 1):
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    ids, masks = np.asarray(prompts), np.asarray(prompt_masks)
    R, P = ids.shape
    concrete = not isinstance(budgets, jax.core.Tracer)
    row_budgets = np.asarray(budgets) if concrete else np.full(R * num_samples, max_new_tokens)
    pp = plan_pages(
        ids, masks, row_budgets, num_samples=num_samples, max_new_tokens=max_new_tokens,
        page_size=int(page_size),
    )  # fmt: skip
    if num_pages is None:
        num_pages = base.slots * pp.max_pages
    elif not (_is_int(num_pages) and num_pages >= 1):
        raise ValueError(f"num_pages must be a positive int or None, got {num_pages!r}")
    check_pool(pp, int(num_pages), int(page_size), np.repeat(masks.sum(axis=1), num_samples))
    plan = _PagedPlan(
        base=base,
        page_size=int(page_size),
        num_pages=int(num_pages),
        max_pages=pp.max_pages,
        prefix_ids=pp.prefix_ids,
    )
    out, peak, in_use, shared, stalls = _generate_paged_jit(
        policy, prompts, prompt_masks, keys, budgets, jnp.asarray(pp.prefix_key),
        jnp.asarray(pp.canon), plan,
    )  # fmt: skip
    pool = jax.eval_shape(lambda: PagedKVCache.empty(policy, 1, int(page_size)))
    page_bytes = pool.page_bytes
    token_bytes = page_bytes // int(page_size)
    stats = PagedCacheStats(
        peak_pages=peak,
        pages_in_use=in_use,
        pages_shared=shared,
        stalls=stalls,
        num_pages=int(num_pages),
        page_size=int(page_size),
        page_bytes=page_bytes,
        dense_bytes=base.slots * (P + max_new_tokens) * token_bytes,
    )
    return out, stats
