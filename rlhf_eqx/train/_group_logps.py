"""Token log-probabilities of GRPO groups with their prompt computed once.

`generate_batch(..., num_samples=G)` returns each prompt's `G` completions in `G`
consecutive rows that hold the same (left-padded) prompt in positions `[0, P)`. The
update's forward passes need not run that prompt `G` times: packed as one row
`[prompt | completion 1 | … | completion G]` whose completions each attend to the prompt
and to themselves only (`attention_layout` with `branch_ids`, fixed `regions`), every
completion token gets the log-probability it has in its own row, while the prompt's
projections, MLPs and keys/values are computed once per group. With 64-token prompts,
groups of 4 and 128-token completions that is a quarter of the positions.
"""

import jax.numpy as jnp
import numpy as np


def group_layout(P: int, G: int, N: int):
    """Branch ids `[P + G·N]` and regions of one packed group row."""
    branch = np.concatenate(
        [np.zeros(P, np.int32), np.repeat(np.arange(1, G + 1, dtype=np.int32), N)]
    )
    return jnp.asarray(branch), (P,) + (N,) * G


def pack_groups(x, P: int, G: int):
    """`[B, T]` rows of groups of `G` sharing `[0, P)` -> `[B / G, P + G·(T - P)]`."""
    B, T = x.shape
    g = x.reshape(B // G, G, T)
    return jnp.concatenate([g[:, 0, :P], g[:, :, P:].reshape(B // G, G * (T - P))], axis=1)


def unpack_groups(y, P: int, G: int):
    """Inverse of `pack_groups` on the completion positions; the prompt positions get 0."""
    n, L = y.shape
    N = (L - P) // G
    comp = y[:, P:].reshape(n * G, N)
    return jnp.concatenate([jnp.zeros((n * G, P), y.dtype), comp], axis=1)


def shared_prompt_logprobs(model, batch, select, *, key, temperature: float, with_entropy: bool):
    """`model.selected_logprobs` on the packed groups, returned in the `[B, T]` layout."""
    P, G = batch.prompt_length, batch.samples_per_prompt
    B, T = batch.tokens.shape
    if B % G:
        raise ValueError(
            f"a (micro-)batch of {B} rows does not split into groups of samples_per_prompt={G}: "
            "use a micro_batches count that keeps whole groups together"
        )
    branch, regions = group_layout(P, G, T - P)
    n = B // G
    out = model.selected_logprobs(
        pack_groups(batch.tokens, P, G),
        pack_groups(batch.mask, P, G),
        pack_groups(select, P, G),
        branch_ids=jnp.broadcast_to(branch, (n, branch.shape[0])),
        regions=regions,
        key=key,
        temperature=temperature,
        with_entropy=with_entropy,
    )
    return tuple(unpack_groups(x, P, G) for x in out)
