"""Data: tokenizers, preference and prompt readers, quality checks, fixed-shape batches,
iteration, sharding.

Everything here runs on the host (plain Python and numpy); the collate functions return
the batch pytrees (`SequenceBatch`, `PreferenceBatch`, `PromptBatch`, ...) as jax arrays
(int32 tokens, bool masks). Every step's batch type is defined here (the sequence,
preference and prompt batches are re-exported at the top level, the others by
`rlhf_eqx.train`). This module is the one public list of the data layer's names; the
private modules behind it have none. A typical DPO input pipeline:

```python
from rlhf_eqx import data

tok = data.load_tokenizer("tok512.bin")
data.check_vocab(tok, policy.cfg.vocab_size)
lengths = data.SequenceLengths(max_length=512, max_prompt_length=256)
records = data.load_preferences("train.jsonl.gz")
print(data.preference_quality(records, tokenizer=tok, lengths=lengths).summary())
records, dropped = data.filter_preferences(records)    # identical, empty, duplicate pairs
train, held_out = data.split_held_out(records, fraction=0.05, seed=0)
pairs, report = data.tokenize_preferences(train, tok, lengths=lengths)
print(report.summary())  # e.g. "12% (96/800) of prompts were cut to 256 tokens (kept the end); ..."
for idx in data.BatchIterator(len(pairs), batch_size=8, seed=0, num_epochs=1):
    batch = data.collate_preferences([pairs[i] for i in idx], lengths=lengths,
                                     pad_id=tok.pad_id, vocab_size=policy.cfg.vocab_size)
```
"""

from ._answers import (
    exact_match_reward as exact_match_reward,
    extract_gsm8k_answer as extract_gsm8k_answer,
    extract_last_number as extract_last_number,
    normalise_number as normalise_number,
)
from ._arrow import dataset_files as dataset_files
from ._batches import (
    BootstrapBatch as BootstrapBatch,
    DistillBatch as DistillBatch,
    GRPOBatch as GRPOBatch,
    KTOBatch as KTOBatch,
    PackedPreferenceBatch as PackedPreferenceBatch,
    PPOBatch as PPOBatch,
    PreferenceBatch as PreferenceBatch,
    PRMBatch as PRMBatch,
    PromptBatch as PromptBatch,
    SequenceBatch as SequenceBatch,
)
from ._byte_tokenizer import ByteTokenizer as ByteTokenizer
from ._chat import (
    CHATML_TEMPLATE as CHATML_TEMPLATE,
    HH_TEMPLATE as HH_TEMPLATE,
    ChatTemplate as ChatTemplate,
    format_chat as format_chat,
    join_reply as join_reply,
    render_prompt as render_prompt,
)
from ._chat_spans import token_offsets as token_offsets
from ._collate import (
    check_token_ids as check_token_ids,
    collate_preferences as collate_preferences,
    collate_prompts as collate_prompts,
    collate_sft as collate_sft,
    padding_stats as padding_stats,
)
from ._columns import COLUMN_NAMES as COLUMN_NAMES
from ._demonstrations import (
    ASSISTANT_TURNS as ASSISTANT_TURNS,
    DEMONSTRATION_FORMATS as DEMONSTRATION_FORMATS,
    DemonstrationDataset as DemonstrationDataset,
    DemonstrationRecord as DemonstrationRecord,
    load_demonstrations as load_demonstrations,
    tokenize_demonstrations as tokenize_demonstrations,
)
from ._errors import DataError as DataError
from ._gguf_tokenizer import (
    byte_alphabet as byte_alphabet,
    tokenizer_from_gguf as tokenizer_from_gguf,
)
from ._gguf_tokenizer_export import add_tokenizer_metadata as add_tokenizer_metadata
from ._hf_tokenizer import HFTokenizer as HFTokenizer
from ._io import LoadReport as LoadReport
from ._jinja_chat import (
    JinjaChatTemplate as JinjaChatTemplate,
    RenderedChat as RenderedChat,
    load_chat_template as load_chat_template,
)
from ._llama2c_tokenizer import Llama2cTokenizer as Llama2cTokenizer
from ._load_tokenizer import is_gguf_file as is_gguf_file, load_tokenizer as load_tokenizer
from ._loader import (
    BatchIterator as BatchIterator,
    IteratorState as IteratorState,
    epoch_permutation as epoch_permutation,
)
from ._packing import (
    pack_preference_steps as pack_preference_steps,
    pack_preferences as pack_preferences,
    packed_from_preferences as packed_from_preferences,
    packed_length as packed_length,
)
from ._preferences import (
    PREFERENCE_FORMATS as PREFERENCE_FORMATS,
    PreferenceDataset as PreferenceDataset,
    PreferenceRecord as PreferenceRecord,
    load_preferences as load_preferences,
    split_hh_transcript as split_hh_transcript,
    split_implicit_prompt as split_implicit_prompt,
)
from ._prm import (
    StepwiseDataset as StepwiseDataset,
    StepwiseRecord as StepwiseRecord,
    TokenizedSteps as TokenizedSteps,
    collate_stepwise as collate_stepwise,
    load_stepwise as load_stepwise,
    separator_id as separator_id,
    tokenize_stepwise as tokenize_stepwise,
)
from ._prompts import (
    PROMPT_FORMATS as PROMPT_FORMATS,
    PromptDataset as PromptDataset,
    PromptRecord as PromptRecord,
    load_prompts as load_prompts,
)
from ._quality import (
    DemonstrationQuality as DemonstrationQuality,
    LengthStats as LengthStats,
    PreferenceQuality as PreferenceQuality,
    demonstration_quality as demonstration_quality,
    distinct_n as distinct_n,
    filter_preferences as filter_preferences,
    preference_quality as preference_quality,
)
from ._sentencepiece_tokenizer import SentencePieceTokenizer as SentencePieceTokenizer
from ._sft_packing import (
    PackedSequenceBatch as PackedSequenceBatch,
    pack_sft as pack_sft,
)
from ._sharding import (
    assign_shards as assign_shards,
    prompt_hash as prompt_hash,
    shard_of as shard_of,
    split_held_out as split_held_out,
)
from ._tokenize import (
    tokenize_preferences as tokenize_preferences,
    tokenize_prompts as tokenize_prompts,
    tokenize_sft as tokenize_sft,
    wants_bos as wants_bos,
)
from ._tokenized import (
    SequenceLengths as SequenceLengths,
    TokenizedPair as TokenizedPair,
    TokenizedSequence as TokenizedSequence,
    TokenizeReport as TokenizeReport,
)
from ._tokenizer import (
    Tokenizer as Tokenizer,
    check_vocab as check_vocab,
    decode_continuation as decode_continuation,
)
from ._unpaired import (
    TokenizedUnpaired as TokenizedUnpaired,
    UnpairedDataset as UnpairedDataset,
    UnpairedRecord as UnpairedRecord,
    collate_unpaired as collate_unpaired,
    load_unpaired as load_unpaired,
    tokenize_unpaired as tokenize_unpaired,
    unpaired_from_preferences as unpaired_from_preferences,
)
