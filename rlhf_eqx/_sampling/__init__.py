"""Sampling with a KV cache: one compiled prefill + decode loop.

Prompts may be left- or right-padded (positions and attention come from the mask).
Left padding is recommended for batches (`rlhf_eqx.data` collates prompts that way):
the completion then starts right after the last real prompt token in every row.
The output row is always `prompt (as given, with its padding) ++ completion`.
"""

from ._continuous import (
    ContinuousDecoding as ContinuousDecoding,
    generate_continuous as generate_continuous,
)
from ._decode import (
    check_prompt_masks as check_prompt_masks,
    generate as generate,
    generate_batch as generate_batch,
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
