"""Sampling with a KV cache: one compiled prefill + decode loop.

Prompts may be left- or right-padded (positions and attention come from the mask).
Left padding is recommended for batches (`rlhf_eqx.data` collates prompts that way):
the completion then starts right after the last real prompt token in every row.
The output row is always `prompt (as given, with its padding) ++ completion`.

Every sampler takes prompts as JAX or NumPy integer arrays and masks as bools or 0 / 1
integers (a tokenizer's `input_ids` and `attention_mask`), converted on the host by
`prompt_arrays` (its checks: ids inside the vocabulary, 0 / 1 mask values, a real token
in every row).
"""

from ._continuous import (
    ContinuousDecoding as ContinuousDecoding,
    generate_continuous as generate_continuous,
)
from ._decode import (
    bool_masks as bool_masks,
    check_prompt_masks as check_prompt_masks,
    generate as generate,
    generate_batch as generate_batch,
    prompt_arrays as prompt_arrays,
)
from ._options import (
    DEFAULT_TEMPERATURE as DEFAULT_TEMPERATURE,
    GenerationOutput as GenerationOutput,
    SamplingOptions as SamplingOptions,
)
from ._paged import PagedCacheStats as PagedCacheStats, generate_paged as generate_paged
from ._penalties import context_counts as context_counts, penalize_logits as penalize_logits
from ._speculative import (
    SpeculativeStats as SpeculativeStats,
    generate_speculative as generate_speculative,
)
from ._stop_strings import truncate_at_stop_strings as truncate_at_stop_strings
from ._token import filter_logits as filter_logits, sample_token as sample_token
