"""Fixed-shape batch pytrees shared by the data readers (producers) and the steps (consumers).

Every batch type of the library is here, so that the readers build them without
importing the steps: `SequenceBatch` (SFT), `PreferenceBatch` and `PackedPreferenceBatch`
(reward model, DPO), `PromptBatch` (generation), `KTOBatch`, `DistillBatch`, `GRPOBatch`,
`PPOBatch`, `PRMBatch` and `BootstrapBatch` (a reward ensemble's resampled pairs). All
are exported by `rlhf_eqx.data`; the first four also at the top level (`rlhf_eqx`), the
others also by `rlhf_eqx.train`, next to their steps.

Every field carries a leading batch axis `B`. Sequences are right-padded (real tokens
first, then padding) unless stated otherwise; the models accept any padding, because
positions come from the mask.

**Validation.** A batch checks itself when it is constructed (`__check_init__`), from
static shapes and dtypes only, so construction works the same under `jax.jit`,
`jax.vmap` and `eqx.tree_at`: token fields must be integer arrays of rank 2, masks
boolean arrays of the same shape, cached reference log-probabilities floating arrays of
shape `[B]`, and neither `B` nor `T` may be 0. A field whose shape or dtype disagrees
with its annotation (a mask of another shape than the tokens) raises jaxtyping's
`TypeCheckError` first, with the runtime shape checks on (the default); what the
annotations cannot say (`B` or `T` of 0), and every case with the checks off, is a
`DataError` (a `ValueError`) naming the batch, the field and the shapes. Only array
fields are checked; other leaves (such as
the integers of an `in_axes` specification, or `None` for an optional field) pass
untouched. Transformations that rebuild a batch from its leaves (`jax.tree.map`,
`jax.vmap` of a per-sample function, which sees a batch without its leading axis,
`eqx.tree_at`, micro-batch reshapes) do not construct it again and are not checked.
"""

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._errors import DataError


def _is_array(x: object) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_floating(kind: str, name: str, x: Array, hint: str = "") -> None:
    """Refuse the field `kind.name` unless its dtype is floating point (`hint`: what it
    holds, said after "floating point")."""
    if not np.issubdtype(np.dtype(x.dtype), np.floating):
        raise DataError(f"{kind}.{name} must be floating point{hint}, got dtype {x.dtype}")


def _validate(
    batch: eqx.Module,
    tokens: tuple[str, ...],
    masks: tuple[str, ...],
    per_row: tuple[str, ...] = (),
) -> None:
    """Check ranks, dtypes and shared shapes of a batch's array fields (static only)."""
    kind = type(batch).__name__
    shape: tuple[int, ...] | None = None
    first = ""
    for name in tokens + masks:
        x = getattr(batch, name)
        if not _is_array(x):
            continue
        if len(x.shape) != 2:
            raise DataError(
                f"{kind}.{name} must be a batch of sequences [B, T], got shape "
                f"{tuple(x.shape)} (an unbatched row? add a leading batch axis)"
            )
        if name in tokens and not np.issubdtype(np.dtype(x.dtype), np.integer):
            raise DataError(f"{kind}.{name} must hold integer token ids, got dtype {x.dtype}")
        if name in masks and np.dtype(x.dtype) != np.bool_:
            raise DataError(
                f"{kind}.{name} must be a boolean mask, got dtype {x.dtype} "
                "(convert with `mask.astype(bool)`)"
            )
        if shape is None:
            shape, first = tuple(x.shape), name
            if 0 in shape:
                raise DataError(
                    f"{kind}.{name} has shape {shape}: a batch needs at least one row "
                    "and one position"
                )
        elif tuple(x.shape) != shape:
            raise DataError(
                f"{kind}.{name} has shape {tuple(x.shape)} but {kind}.{first} has shape "
                f"{shape}; every field must have the same [B, T]"
            )
    for name in per_row:
        x = getattr(batch, name)
        if not _is_array(x):
            continue
        _check_floating(kind, name, x)
        if shape is not None and tuple(x.shape) != shape[:1]:
            raise DataError(
                f"{kind}.{name} has shape {tuple(x.shape)} but the batch has "
                f"B={shape[0]} rows ({kind}.{first} has shape {shape}); expected ({shape[0]},)"
            )


class SequenceBatch(eqx.Module):
    """Prompt + completion sequences for supervised fine-tuning.

    `mask` marks real tokens; `completion_mask` marks the tokens the loss is taken on
    (a subset of `mask`).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask", "completion_mask"))


class PreferenceBatch(eqx.Module):
    """Preference pairs: the same prompt followed by a chosen and a rejected completion.

    `ref_chosen_logp` / `ref_rejected_logp` hold the reference model's summed completion
    log-probabilities when they were computed once and cached; `None` means the step
    computes them on the fly.

    `margins` holds each pair's own reward margin $m_i$ (a preference file's `margin`
    column, TRL's `RewardTrainer` convention): the reward-model loss is then
    $-\\log\\sigma(r_c - r_r - m - m_i)$ (`rlhf_eqx.train.reward_loss`); `None` (the
    default): no per-pair margin. DPO does not read it.
    """

    chosen_tokens: Int[Array, "B T"]
    chosen_mask: Bool[Array, "B T"]
    chosen_completion_mask: Bool[Array, "B T"]
    rejected_tokens: Int[Array, "B T"]
    rejected_mask: Bool[Array, "B T"]
    rejected_completion_mask: Bool[Array, "B T"]
    ref_chosen_logp: Float[Array, " B"] | None = None
    ref_rejected_logp: Float[Array, " B"] | None = None
    margins: Float[Array, " B"] | None = None

    def __check_init__(self):
        _validate(
            self,
            ("chosen_tokens", "rejected_tokens"),
            (
                "chosen_mask",
                "chosen_completion_mask",
                "rejected_mask",
                "rejected_completion_mask",
            ),
            ("ref_chosen_logp", "ref_rejected_logp", "margins"),
        )


class PackedPreferenceBatch(eqx.Module):
    """Preference pairs packed with a shared prompt: `[prompt | chosen | rejected]` per pair.

    Each pair's prompt is stored once, followed by its chosen and its rejected
    completion; `branch_ids` say which is which (0 prompt, 1 chosen, 2 rejected) and the
    model lets each completion attend to the prompt and to itself only
    (`rlhf_eqx.models.attention_layout`), with the positions it would have in its own
    row. Per pair, the prompt's keys and values are computed once instead of twice, and
    the log-probabilities are those of the unpacked `PreferenceBatch` (`data.pack_preferences`
    builds this batch; `data.packed_from_preferences` converts one):

    ```
    tokens        [BOS p p p | c c EOS | r r r EOS | BOS p p | c EOS | r EOS | pad]
    branch_ids    [ 0  0 0 0 | 1 1  1  | 2 2 2  2  |  0  0 0 | 1  1  | 2  2  |  0 ]
    segment_ids   [ 0  0 0 0 | 0 0  0  | 0 0 0  0  |  1  1 1 | 1  1  | 1  1  |  0 ]
    ```

    A row holds up to `K` pairs, told apart by `segment_ids` (`0 ... K-1`); `pairs[r, k]`
    says whether slot `k` of row `r` holds a pair. With `regions=(P, C, R)` (static;
    `pack_preferences(..., aligned=True)`) every row holds one pair at fixed offsets —
    prompt in `[0, P)`, chosen in `[P, P + C)`, rejected after, each right-padded — and
    the model scores each completion only against the prompt and itself
    (`region_attention`): no work goes to one completion against the other. `completion_mask` marks
    the tokens scored (each completion with its EOS). `ref_chosen_logp` / `ref_rejected_logp`
    (`[R, K]`) hold cached reference log-probabilities, as in `PreferenceBatch`.
    """

    tokens: Int[Array, "R L"]
    mask: Bool[Array, "R L"]
    completion_mask: Bool[Array, "R L"]
    segment_ids: Int[Array, "R L"]
    branch_ids: Int[Array, "R L"]
    pairs: Bool[Array, "R K"]
    ref_chosen_logp: Float[Array, "R K"] | None = None
    ref_rejected_logp: Float[Array, "R K"] | None = None
    regions: tuple[int, int, int] | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        _validate(self, ("tokens", "segment_ids", "branch_ids"), ("mask", "completion_mask"))
        if self.regions is not None:
            regions = self.regions
            ok = len(regions) == 3 and all(isinstance(r, int) and r >= 0 for r in regions)
            L = self.tokens.shape[-1] if _is_array(self.tokens) else None
            if not ok or (L is not None and sum(regions) != L):
                raise DataError(
                    f"{type(self).__name__}.regions={regions!r} must be three non-negative "
                    f"ints (prompt, chosen, rejected) adding up to the row length {L}"
                )
            if _is_array(self.pairs) and self.pairs.shape[-1] != 1:
                raise DataError(f"{type(self).__name__}.regions needs one pair per row (K = 1)")
        kind = type(self).__name__
        rows = self.tokens.shape[0] if _is_array(self.tokens) else None
        pairs = self.pairs
        if _is_array(pairs):
            if len(pairs.shape) != 2 or np.dtype(pairs.dtype) != np.bool_ or 0 in pairs.shape:
                raise DataError(
                    f"{kind}.pairs must be a boolean [R, K] array with K >= 1, got "
                    f"{pairs.dtype} of shape {tuple(pairs.shape)}"
                )
            if rows is not None and pairs.shape[0] != rows:
                raise DataError(
                    f"{kind}.pairs has {pairs.shape[0]} rows but {kind}.tokens has {rows}"
                )
        for name in ("ref_chosen_logp", "ref_rejected_logp"):
            x = getattr(self, name)
            if _is_array(x) and _is_array(pairs) and tuple(x.shape) != tuple(pairs.shape):
                raise DataError(
                    f"{kind}.{name} has shape {tuple(x.shape)}; expected {tuple(pairs.shape)} "
                    "(one value per pair slot, like `pairs`)"
                )
            if _is_array(x):
                _check_floating(kind, name, x)

    @property
    def num_slots(self) -> int:
        """`K`, the pair slots per row."""
        return self.pairs.shape[-1]


class PromptBatch(eqx.Module):
    """Left-padded prompts for generation (PPO / GRPO rollouts)."""

    tokens: Int[Array, "B P"]
    mask: Bool[Array, "B P"]

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask",))


class KTOBatch(eqx.Module):
    """Unpaired examples for KTO: prompt + completion rows, each labelled desirable or not.

    - `tokens`, `mask`, `completion_mask`: `[B, T]` right-padded rows (as a
      `SequenceBatch`); the completion mask marks the scored tokens.
    - `label`: `[B]`, true for a desirable completion, false for an undesirable one.
    - `kl_tokens`, `kl_mask`, `kl_completion_mask`: `[B, T']` the *mismatched* rows that
      estimate the reference point: prompt $i$ followed by another example's completion
      (`data.collate_unpaired` uses the completion of example $i - 1 \\bmod B$, as TRL
      does). Needed by `loss_type="kto"`; `None` for `"apo_zero_unpaired"`.
    - `ref_logp`, `ref_kl_logp`: `[B]` cached reference log-probabilities of the rows
      and of the mismatched rows (`compute_kto_reference_logps`); `None`: the step
      computes them with its `reference=` model.

    Checked at construction like the other batches (`rlhf_eqx.SequenceBatch`): ranks,
    dtypes and shared shapes; the three `kl_*` fields come together or not at all.
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    label: Bool[Array, " B"]
    kl_tokens: Int[Array, "B T2"] | None = None
    kl_mask: Bool[Array, "B T2"] | None = None
    kl_completion_mask: Bool[Array, "B T2"] | None = None
    ref_logp: Float[Array, " B"] | None = None
    ref_kl_logp: Float[Array, " B"] | None = None

    def __check_init__(self):
        kind = type(self).__name__
        _validate(self, ("tokens",), ("mask", "completion_mask"), ("ref_logp", "ref_kl_logp"))
        _validate(self, ("kl_tokens",), ("kl_mask", "kl_completion_mask"))
        kl = (self.kl_tokens, self.kl_mask, self.kl_completion_mask)
        if any(x is None for x in kl) and not all(x is None for x in kl):
            raise DataError(
                f"{kind}.kl_tokens, kl_mask and kl_completion_mask must be given together"
            )
        rows = self.tokens.shape[0] if _is_array(self.tokens) else None
        if _is_array(self.kl_tokens) and rows is not None and self.kl_tokens.shape[0] != rows:
            raise DataError(
                f"{kind}.kl_tokens has {self.kl_tokens.shape[0]} rows but {kind}.tokens has "
                f"{rows}; every example needs one mismatched row"
            )
        label = self.label
        if _is_array(label):
            if np.dtype(label.dtype) != np.bool_:
                raise DataError(
                    f"{kind}.label must be boolean (true: desirable), got dtype {label.dtype}"
                )
            if len(label.shape) != 1 or (rows is not None and label.shape[0] != rows):
                raise DataError(
                    f"{kind}.label has shape {tuple(label.shape)}; expected ({rows},), one "
                    "label per row"
                )


class DistillBatch(eqx.Module):
    """Sequences (prompt + completion) on which a student is distilled from a teacher.

    - `tokens`, `mask`, `completion_mask`: `[B, T]` ids, real tokens, and the completion
      tokens the loss is taken on (as `SequenceBatch`; from a dataset, or a student's
      `generate_batch` output).
    - `teacher_logits`: `[B, T, V]` cached teacher logits, aligned with the model's
      output (`teacher_logits[b, s]` predicts the token after position `s`); `None`
      (default): the GKD step runs its `teacher=` model. Only `make_distill_step` reads it.
    - `old_logp`: `[B, T]` log-probabilities of the tokens under the student when they
      were sampled (`GenerationOutput.logprobs`); `None`: on-policy, the current student
      (importance ratio 1). Only `make_onpolicy_distill_step` reads it.
    - `teacher_logp`: `[B, T]` cached teacher log-probabilities of the tokens; `None`: the
      on-policy step runs its `teacher=` model. Only `make_onpolicy_distill_step` reads it.

    Shapes and dtypes are checked at construction (a `DataError` names the field).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    teacher_logits: Float[Array, "B T V"] | None = None
    old_logp: Float[Array, "B T"] | None = None
    teacher_logp: Float[Array, "B T"] | None = None

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask", "completion_mask"))
        shape = tuple(self.tokens.shape) if _is_array(self.tokens) else None
        for name in ("teacher_logits", "old_logp", "teacher_logp"):
            x = getattr(self, name)
            if not _is_array(x):
                continue
            _check_floating("DistillBatch", name, x)
            got = tuple(x.shape)
            if name == "teacher_logits":
                ok = len(got) == 3 and (shape is None or got[:2] == shape)
                want = "[B, T, V]"
            else:
                ok = len(got) == 2 and (shape is None or got == shape)
                want = "[B, T]"
            if not ok:
                raise DataError(
                    f"DistillBatch.{name} has shape {got}; expected {want} with "
                    f"[B, T] = {shape} (the shape of DistillBatch.tokens)"
                )


def _check_shared_prompts(batch) -> None:
    """Validate a `GRPOBatch`'s `prompt_length` / `samples_per_prompt` (static shapes
    always; the token values when they are concrete, i.e. outside `jax.jit`, and held by
    this process)."""
    P, G = batch.prompt_length, batch.samples_per_prompt
    if P is None and G is None:
        return
    if P is None or G is None:
        raise DataError("GRPOBatch: set both prompt_length and samples_per_prompt, or neither")
    for name, value in (("prompt_length", P), ("samples_per_prompt", G)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"GRPOBatch.{name} must be a positive int, got {value!r}")
    tokens = batch.tokens
    if getattr(tokens, "ndim", 0) != 2:
        return  # a per-sample view (vmap) or a pytree spec: nothing to check here
    B, T = tokens.shape
    if P >= T:
        raise DataError(f"GRPOBatch.prompt_length={P} leaves no completion in rows of {T} tokens")
    if B % G:
        raise DataError(f"GRPOBatch has {B} rows, not a multiple of samples_per_prompt={G}")
    arrays = (tokens, batch.mask, batch.completion_mask)
    if any(isinstance(x, jax.core.Tracer) for x in arrays):
        return
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in arrays):
        return  # rows on other processes' devices too: the values are not all here
    in_prompt = np.asarray(batch.completion_mask)[:, :P] & np.asarray(batch.mask)[:, :P]
    if in_prompt.any():
        row = int(np.argmax(in_prompt.any(axis=1)))
        raise DataError(
            f"GRPOBatch: row {row} marks completion tokens inside its prompt positions [0, {P})"
        )
    tok = np.asarray(tokens)[:, :P].reshape(B // G, G, P)
    msk = np.asarray(batch.mask)[:, :P].reshape(B // G, G, P)
    real = np.where(msk, tok, -1)
    differs = np.any(real != real[:, :1], axis=(1, 2)) | np.any(msk != msk[:, :1], axis=(1, 2))
    if differs.any():
        g = int(np.argmax(differs))
        raise DataError(
            f"GRPOBatch: rows {g * G}..{g * G + G - 1} (group {g}) do not hold the same prompt in "
            f"positions [0, {P}) (prompt_length={P}, samples_per_prompt={G})"
        )


class GRPOBatch(eqx.Module):
    """Sampled completions of a GRPO step: `B = n_prompts * G` rows, groups contiguous.

    - `tokens`, `mask`, `completion_mask`: prompt + completion, real tokens, and the
      completion tokens.
    - `rewards`: `[B]` scalar rewards (e.g. exact-match answers); the step turns them
      into group-relative advantages. Or give `advantages` directly (e.g. RLOO).
    - `old_logp`: `[B, T]` log-probabilities at sampling time (`None`: on-policy, the
      ratio is 1 with the gradient of $\\log\\pi_\\theta$, TRL's single-iteration case).
    - `ref_logp`: `[B, T]` reference log-probabilities (for the KL term; `None`: the
      step computes them from its `reference=` model if `beta != 0`).
    - `truncated`: `[B]` completions cut at the length limit (no EOS).
    - `prompt_length`, `samples_per_prompt` (static, both or neither): each group of
      `samples_per_prompt` consecutive rows holds the same prompt in positions
      `[0, prompt_length)` and only completions after it, as `generate_batch(...,
      num_samples=G)` returns them. The step then runs each prompt once, its `G`
      completions packed after it (shared-prefix packing, as for
      `PackedPreferenceBatch`), for the same loss and gradients with a policy that
      meets `AbstractSelectiveLM`. Checked when the batch is built from concrete
      arrays (a `DataError` names the group).
    - `behaviour_logp`: `[B, T]` log-probabilities of the policy that sampled the
      completions, when it differs from the trainer's (another engine, a lower precision,
      stale parameters; veRL `rollout_log_probs`). The step then logs the mismatch
      metrics, and corrects the loss with the step's `rollout_correction`.
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    rewards: Float[Array, " B"] | None = None
    advantages: Float[Array, " B"] | None = None
    old_logp: Float[Array, "B T"] | None = None
    ref_logp: Float[Array, "B T"] | None = None
    truncated: Bool[Array, " B"] | None = None
    prompt_length: int | None = eqx.field(static=True, default=None)
    samples_per_prompt: int | None = eqx.field(static=True, default=None)
    behaviour_logp: Float[Array, "B T"] | None = None

    def __check_init__(self):
        _check_shared_prompts(self)


class PPOBatch(eqx.Module):
    """A PPO rollout, every per-token field aligned with the token it concerns.

    - `tokens`, `mask`, `completion_mask`: prompt + completion, real tokens, and the
      generated tokens (the actions).
    - `old_logp`: log-probability of each token under the policy that sampled it.
    - `old_values`: value of the state each token was sampled from (`token_values`).
    - `advantages`, `returns`: from `compute_advantages` (0 outside the completion).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    old_logp: Float[Array, "B T"]
    old_values: Float[Array, "B T"]
    advantages: Float[Array, "B T"]
    returns: Float[Array, "B T"]


class PRMBatch(eqx.Module):
    """Solutions with a label at the end of every step, for a process reward model.

    - `tokens`, `mask`: `[B, T]` right-padded prompt + steps (each step followed by the
      separator), and the real tokens.
    - `step_mask`: `[B, T]`, true at the positions whose output is scored: the last
      token of each step's separator.
    - `step_labels`: `[B, T]` float, the label of the step ending at each `step_mask`
      position: 1 (correct) or 0, or a probability (soft labels); ignored elsewhere.

    Checked at construction like the other batches (`rlhf_eqx.SequenceBatch`).
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    step_mask: Bool[Array, "B T"]
    step_labels: Float[Array, "B T"]

    def __check_init__(self):
        _validate(self, ("tokens",), ("mask", "step_mask"))
        labels = self.step_labels
        if _is_array(labels):
            _check_floating("PRMBatch", "step_labels", labels, " (1.0 / 0.0 or a probability)")
            if _is_array(self.tokens) and tuple(labels.shape) != tuple(self.tokens.shape):
                raise DataError(
                    f"PRMBatch.step_labels has shape {tuple(labels.shape)} but PRMBatch.tokens "
                    f"has shape {tuple(self.tokens.shape)}; every field must have the same [B, T]"
                )


class BootstrapBatch(eqx.Module):
    """Preference pairs with a weight per pair and member (bootstrap resampling).

    - `pairs`: a `PreferenceBatch` (`B` pairs) or a `PackedPreferenceBatch` (`[R, Kp]`
      pair slots).
    - `weights`: `[B, K]` (or `[R, Kp, K]`): how often member `k` sees pair `i` in this
      batch (e.g. `bootstrap_weights`); member `k`'s loss is
      $\\sum_i w_{ik}\\ell_{ik} / \\sum_i w_{ik}$ (a member whose weights are all 0 over
      the global batch is not updated: `empty_batch/members`).

    The member axis is last, so micro-batching and `jax.pmap` split the pairs as usual.
    """

    pairs: PreferenceBatch | PackedPreferenceBatch
    weights: Float[Array, "*pairs K"]

    def __check_init__(self):
        w, p = self.weights, self.pairs
        if not _is_array(w):
            return
        _check_floating("BootstrapBatch", "weights", w)
        if isinstance(p, PackedPreferenceBatch):
            slots = tuple(p.pairs.shape) if _is_array(p.pairs) else None
        else:
            slots = tuple(p.chosen_tokens.shape[:1]) if _is_array(p.chosen_tokens) else None
        if slots is not None and tuple(w.shape[:-1]) != slots:
            raise DataError(
                f"BootstrapBatch.weights has shape {tuple(w.shape)}; expected {slots + ('K',)} "
                "(one weight per pair and member, the member axis last)"
            )
