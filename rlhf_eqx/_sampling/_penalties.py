"""The repetition, presence and frequency penalties of the tokens a row has already seen
(`penalize_logits`), and the per-row counts the decode loops carry for them."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._options import check_penalty, check_repetition_penalty

_NAMES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def penalize_logits(
    logits: Float[Array, "*B V"],
    context: Bool[Array, "*B V"] | Int[Array, "*B V"],
    generated: Int[Array, "*B V"],
    *,
    repetition_penalty: float | int | Float[Array | np.ndarray, "*B"] = 1.0,
    presence_penalty: float | int | Float[Array | np.ndarray, "*B"] = 0.0,
    frequency_penalty: float | int | Float[Array | np.ndarray, "*B"] = 0.0,
) -> Float[Array, "*B V"]:
    """Penalise the logits of the tokens a row has already seen.

    **Arguments:**

    - `logits`: the model's raw next-token logits `l` (before the temperature and the
      top-k / top-p / min-p filters, as Hugging Face and vLLM apply penalties).
    - `context`: where token `v` appears in the row's context so far (nonzero or
      `True`): the prompt's real tokens (never its padding), the tokens generated so
      far and, in a multi-turn episode, the earlier turns and the observations.
    - `generated`: `c_v`, how many times the row has generated token `v` so far (the
      prompt and observations not counted).
    - `repetition_penalty` `r > 0` (1: off; CTRL, Keskar et al. 2019, as Hugging Face's
      `RepetitionPenaltyLogitsProcessor` and vLLM apply it), `presence_penalty` `p` and
      `frequency_penalty` `f` (OpenAI's API and vLLM, in [-2, 2], 0: off): numbers, or
      one value per row (`[*B]` arrays, traced, always applied; NumPy arrays too).

    **Returns:** the penalised logits,

    $$l'_v = \\begin{cases} l_v / r & \\text{$v$ in the context and } l_v > 0 \\\\
    l_v \\cdot r & \\text{$v$ in the context and } l_v \\le 0 \\\\ l_v & \\text{otherwise}
    \\end{cases}, \\qquad l''_v = l'_v - f \\, c_v - p \\, [c_v > 0],$$

    in vLLM's order (`apply_penalties`: the repetition penalty, then the frequency and
    presence terms). `r > 1`, `p > 0`, `f > 0` discourage repeats; values below make them
    likelier. A scalar that is off skips its term: all three off returns `logits`
    itself. Raises `ValueError` naming the argument for a scalar out of range.
    """
    scalars = (repetition_penalty, presence_penalty, frequency_penalty)
    per_row = [isinstance(x, jax.Array | np.ndarray) for x in scalars]
    if not per_row[0]:
        check_repetition_penalty(repetition_penalty)
    for name, value, traced in zip(_NAMES[1:], scalars[1:], per_row[1:]):
        if not traced:
            check_penalty(name, value)

    def row(x):  # a per-row value against its row's logits; a scalar as it is
        x = jnp.asarray(x, logits.dtype)
        return x[..., None] if x.ndim else x

    out = logits
    if per_row[0] or repetition_penalty != 1:
        r = row(repetition_penalty)
        out = jnp.where(context.astype(bool), jnp.where(out > 0, out / r, out * r), out)
    if per_row[2] or frequency_penalty != 0:
        out = out - row(frequency_penalty) * generated.astype(logits.dtype)
    if per_row[1] or presence_penalty != 0:
        out = out - row(presence_penalty) * (generated > 0).astype(logits.dtype)
    return out


class Seen(eqx.Module):
    """What the penalties of `S` rows (or decode slots) need, carried through a decode
    loop: `context[s, v]` whether token `v` is in row `s`'s context (its prompt's real
    tokens and the tokens generated so far), `generated[s, v]` how many times the row
    generated it."""

    context: Bool[Array, "S V"]
    generated: Int[Array, "S V"]

    @classmethod
    def of_prompts(
        cls, prompts: Int[Array, "S P"], prompt_masks: Bool[Array, "S P"], vocab_size: int
    ) -> "Seen":
        """The prompts' real tokens as context (padding never counts), nothing generated."""
        S = prompts.shape[0]
        return cls(
            context=_present(prompts, prompt_masks, vocab_size),
            generated=jnp.zeros((S, vocab_size), jnp.int32),
        )

    def admitted(self, slot, prompt: Int[Array, " P"], prompt_mask: Bool[Array, " P"]) -> "Seen":
        """Slot `slot` starting a new row with `prompt` (its real tokens)."""
        V = self.context.shape[-1]
        return Seen(
            context=self.context.at[slot].set(_present(prompt[None], prompt_mask[None], V)[0]),
            generated=self.generated.at[slot].set(0),
        )

    def after(self, tokens: Int[Array, " S"], real: Bool[Array, " S"]) -> "Seen":
        """With each row's sampled token added where `real`."""
        rows = jnp.arange(tokens.shape[0])
        at = jnp.where(real, tokens, self.context.shape[-1])  # out of range: dropped
        return Seen(
            context=self.context.at[rows, at].set(True, mode="drop"),
            generated=self.generated.at[rows, at].add(1, mode="drop"),
        )


def _present(ids: Int[Array, "S P"], masks: Bool[Array, "S P"], V: int) -> Bool[Array, "S V"]:
    """`[S, V]`: whether each id appears at a real position (`masks`) of its row."""
    rows = jnp.arange(ids.shape[0])[:, None]
    counts = jnp.zeros((ids.shape[0], V), jnp.int32)
    counts = counts.at[rows, ids].add(masks.astype(jnp.int32), mode="drop")
    return counts > 0


def context_counts(
    tokens: Int[Array, " T"], context: Bool[Array, " T"], generated: Bool[Array, " T"], V: int
) -> tuple[Bool[Array, " V"], Int[Array, " V"]]:
    """One row's `(context, generated)` from its token buffer: the ids at the positions of
    `context` (any real token) and the counts of those at `generated` (sampled ones)."""
    counts = jnp.zeros((V,), jnp.int32)
    seen = counts.at[tokens].add(context.astype(jnp.int32), mode="drop") > 0
    return seen, counts.at[tokens].add(generated.astype(jnp.int32), mode="drop")
