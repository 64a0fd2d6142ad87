"""The decoder models as immutable pytrees (`Policy`, `ValueModel`, `RewardModel`) and their
checkpoints."""

from ._attention import attention as attention, region_attention as region_attention
from ._config import RopeScaling as RopeScaling, TransformerConfig as TransformerConfig
from ._decode_attention import cached_attention as cached_attention
from ._decoder_layer import LORA_TARGETS as LORA_TARGETS, DecoderLayer as DecoderLayer
from ._draft import truncated_draft as truncated_draft
from ._gguf import (
    load_gguf_policy as load_gguf_policy,
    open_gguf as open_gguf,
    read_gguf_card as read_gguf_card,
)
from ._gguf_blocks import (
    GGUF_BLOCKS as GGUF_BLOCKS,
    GGUFMixedWeight as GGUFMixedWeight,
    GGUFWeight as GGUFWeight,
    dequantize_rows as dequantize_rows,
    quantize_gguf as quantize_gguf,
)
from ._gguf_config import read_gguf_sizes as read_gguf_sizes
from ._gguf_export import save_gguf_adapter as save_gguf_adapter, write_gguf as write_gguf
from ._heads import (
    Policy as Policy,
    RewardModel as RewardModel,
    ValueModel as ValueModel,
    last_real_index as last_real_index,
)
from ._hf import (
    config_from_hf as config_from_hf,
    config_to_hf as config_to_hf,
    load_hf as load_hf,
    save_hf as save_hf,
)
from ._layers import (
    AbstractQuantizedWeight as AbstractQuantizedWeight,
    Int8Weight as Int8Weight,
    LoRAAdapter as LoRAAdapter,
    NF4Weight as NF4Weight,
    activation as activation,
    gated_activation as gated_activation,
    matmul as matmul,
    rms_norm as rms_norm,
)
from ._llama2c import (
    load_llama2c_policy as load_llama2c_policy,
    permute_rotary_rows as permute_rotary_rows,
    read_llama2c as read_llama2c,
    read_llama2c_header as read_llama2c_header,
)
from ._lora import (
    DoRAAdapter as DoRAAdapter,
    LayerwiseLoRAAdapter as LayerwiseLoRAAdapter,
    LoRAConfig as LoRAConfig,
    apply_lora as apply_lora,
    count_params as count_params,
    lora_filter as lora_filter,
    merge_lora as merge_lora,
    without_lora as without_lora,
)
from ._masks import attention_layout as attention_layout, previous_allowed as previous_allowed
from ._native_rows import (
    NATIVE_MIN_DENSE as NATIVE_MIN_DENSE,
    native_dense_product as native_dense_product,
    native_rows_available as native_rows_available,
    native_rows_product as native_rows_product,
)
from ._packed_products import (
    PACKED_KINDS as PACKED_KINDS,
    few_rows_product as few_rows_product,
    packed_product as packed_product,
)
from ._packing import branch_last_index as branch_last_index, branch_sums as branch_sums
from ._paged_attention import (
    PagedKVCache as PagedKVCache,
    gather_pages as gather_pages,
    paged_attention as paged_attention,
    paged_decode_step as paged_decode_step,
)
from ._peft import load_lora_adapter as load_lora_adapter, save_lora_adapter as save_lora_adapter
from ._protocols import (
    AbstractBatchedModel as AbstractBatchedModel,
    AbstractBranchScorer as AbstractBranchScorer,
    AbstractChunkDecoder as AbstractChunkDecoder,
    AbstractDecoder as AbstractDecoder,
    AbstractScalarModel as AbstractScalarModel,
    AbstractSelectiveLM as AbstractSelectiveLM,
    AbstractSequenceModel as AbstractSequenceModel,
)
from ._quant import (
    dequantize as dequantize,
    quantize_int8 as quantize_int8,
    quantize_nf4 as quantize_nf4,
    quantize_weight_int8 as quantize_weight_int8,
    quantize_weight_nf4 as quantize_weight_nf4,
)
from ._sharding import partition_specs as partition_specs
from ._transformer import (
    ATTENTION_BLOCK as ATTENTION_BLOCK,
    KVCache as KVCache,
    Transformer as Transformer,
    with_remat as with_remat,
)
