"""Llama-family models as immutable pytrees: `Policy`, `ValueModel`, `RewardModel`."""

from ._config import TransformerConfig as TransformerConfig
from ._heads import (
    Policy as Policy,
    RewardModel as RewardModel,
    ValueModel as ValueModel,
    last_real_index as last_real_index,
)
from ._layers import Int8Weight as Int8Weight, LoRAAdapter as LoRAAdapter
from ._transformer import (
    LORA_TARGETS as LORA_TARGETS,
    DecoderLayer as DecoderLayer,
    KVCache as KVCache,
    Transformer as Transformer,
)
