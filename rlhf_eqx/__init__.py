"""rlhf_eqx: pure-functional preference alignment for language models in JAX.

Models are immutable ``eqx.Module`` pytrees; updates are pure functions
``(params, opt_state, batch) -> (params, opt_state, metrics)``. Every public function's
array shapes and dtypes are checked at runtime by default (at trace time under
``jax.jit``); set ``RLHF_EQX_TYPECHECK=0`` before import to turn the checks off (see
``rlhf_eqx._typecheck``).
"""

from ._typecheck import typecheck_requested as _typecheck_requested

if _typecheck_requested():
    from ._typecheck import install_hook as _install_hook

    _install_hook()

from . import data as data, losses as losses, models as models, ops as ops, train as train
from .models import (
    KVCache as KVCache,
    LoRAConfig as LoRAConfig,
    Policy as Policy,
    RewardModel as RewardModel,
    Transformer as Transformer,
    TransformerConfig as TransformerConfig,
    ValueModel as ValueModel,
    apply_lora as apply_lora,
    count_params as count_params,
    dequantize as dequantize,
    load_hf as load_hf,
    lora_filter as lora_filter,
    merge_lora as merge_lora,
    quantize_int8 as quantize_int8,
    quantize_nf4 as quantize_nf4,
    save_hf as save_hf,
    with_remat as with_remat,
    without_lora as without_lora,
)
from .ops import (
    entropy_from_logits as entropy_from_logits,
    logprobs_from_logits as logprobs_from_logits,
    masked_mean as masked_mean,
    masked_sum as masked_sum,
    masked_var as masked_var,
    masked_whiten as masked_whiten,
    previous_real_index as previous_real_index,
    token_entropy as token_entropy,
    token_logprobs as token_logprobs,
)

__version__ = "0.1.0"

from . import distributed as distributed, envs as envs, serving as serving
from ._compilation_cache import (
    compilation_cache_dir as compilation_cache_dir,
    enable_compilation_cache as enable_compilation_cache,
)
from ._pretrained import (
    load_gguf as load_gguf,
    load_llama2c as load_llama2c,
    save_gguf as save_gguf,
)
from ._sampling import (
    DEFAULT_TEMPERATURE as DEFAULT_TEMPERATURE,
    ContinuousDecoding as ContinuousDecoding,
    GenerationOutput as GenerationOutput,
    PagedCacheStats as PagedCacheStats,
    SamplingOptions as SamplingOptions,
    SpeculativeStats as SpeculativeStats,
    filter_logits as filter_logits,
    generate as generate,
    generate_batch as generate_batch,
    generate_continuous as generate_continuous,
    generate_paged as generate_paged,
    generate_speculative as generate_speculative,
    penalize_logits as penalize_logits,
    sample_token as sample_token,
    truncate_at_stop_strings as truncate_at_stop_strings,
)
from .data import (
    PackedPreferenceBatch as PackedPreferenceBatch,
    PreferenceBatch as PreferenceBatch,
    PromptBatch as PromptBatch,
    SequenceBatch as SequenceBatch,
)
from .distributed import (
    MemoryEstimate as MemoryEstimate,
    estimate_memory as estimate_memory,
)
from .models import (
    RopeScaling as RopeScaling,
    load_lora_adapter as load_lora_adapter,
    save_lora_adapter as save_lora_adapter,
)
