"""The host-side plan of a paged-cache run: which prompt pages are shared, which prompts
are prefilled for which, and how many pages each request may need.

The requests are known before the loop starts, so shared prefixes are found on the host,
at page granularity: a prompt's `j`-th full page is keyed by its real tokens up to the
end of that page (keys and values at a position depend on every token before it), and
every row whose prompt has the same real tokens there maps that page to one physical
page. Prompts whose real tokens are identical are prefilled once (for the first of
them).
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PagePlan:
    """`prefix_key[r, j]`: the shared-page id of prompt `r`'s `j`-th full page (`-1`
    past its full pages), ids in `[0, R · (P // page_size))`; `canon[r]`: the first
    prompt with the same real tokens (prefilled for it); `worst[b]`: the most pages row
    `b` can hold (its prompt and its budget); `max_pages`: page-table width."""

    prefix_key: np.ndarray  # int32 [R, M]
    canon: np.ndarray  # int32 [R]
    worst: np.ndarray  # int64 [B]
    max_pages: int
    prefix_ids: int
    shareable: int  # full prompt pages of all rows minus distinct ones


def plan_pages(
    prompts: np.ndarray,
    prompt_masks: np.ndarray,
    budgets: np.ndarray,
    *,
    num_samples: int,
    max_new_tokens: int,
    page_size: int,
) -> PagePlan:
    """The plan for `[R, P]` concrete prompts and the `[R · num_samples]` row budgets."""
    R, P = prompts.shape
    ps = page_size
    M = -(-(P + max_new_tokens) // ps)
    F = max(P // ps, 1)
    prefix_key = np.full((R, M), -1, np.int32)
    canon = np.zeros((R,), np.int32)
    pages: dict[bytes, int] = {}
    firsts: dict[bytes, int] = {}
    n_real = prompt_masks.sum(axis=1)
    for r in range(R):
        real = np.asarray(prompts[r][prompt_masks[r]], np.int64)
        canon[r] = firsts.setdefault(real.tobytes(), r)
        for j in range(len(real) // ps):
            prefix_key[r, j] = pages.setdefault(real[: (j + 1) * ps].tobytes(), len(pages))
    rows = np.repeat(n_real, num_samples)
    # tokens a row stores: its prompt and every sampled token but the last (never fed)
    worst = -(-(rows + budgets - 1) // ps)
    full = (rows // ps).sum()
    return PagePlan(
        prefix_key=prefix_key,
        canon=canon,
        worst=worst,
        max_pages=M,
        prefix_ids=R * F,
        shareable=int(full - len(pages)),
    )


def check_pool(plan: PagePlan, num_pages: int, page_size: int, prompt_lengths: np.ndarray):
    """Refuse, in one line, a pool too small for the largest request on its own."""
    b = int(np.argmax(plan.worst))
    need = int(plan.worst[b])
    if need > num_pages:
        n = int(prompt_lengths[b])
        raise ValueError(
            f"num_pages={num_pages} is too small: request row {b} may hold {need} pages of "
            f"{page_size} tokens (a {n}-token prompt and its budget), more than the pool; "
            f"use num_pages >= {need}"
        )
