"""Sentencepiece models (`.model`) as tokenizers."""

import os

from ._errors import DataError
from ._tokenizer import TokenIds, int_ids


class SentencePieceTokenizer:
    """A sentencepiece model (`.model`, e.g. Llama 1/2, Mistral, Gemma).

    BOS/EOS/padding are the model's own ids; a model without a padding piece pads with
    the unknown-piece id (padding is always masked). `decode` skips BOS, EOS and the
    padding piece (when the model has one).
    """

    def __init__(self, processor):
        self.processor = processor
        self.vocab_size: int = int(processor.get_piece_size())
        bos, eos, pad, unk = (
            int(processor.bos_id()),
            int(processor.eos_id()),
            int(processor.pad_id()),
            int(processor.unk_id()),
        )
        if eos < 0:
            raise DataError("the sentencepiece model has no EOS piece")
        self.eos_id: int = eos
        self.bos_id: int = bos if bos >= 0 else eos
        self.pad_id: int = pad if pad >= 0 else max(unk, 0)
        self._skip: frozenset[int] = frozenset(
            {self.bos_id, self.eos_id} | ({pad} if pad >= 0 else set())
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        import sentencepiece as spm

        return cls(spm.SentencePieceProcessor(model_file=os.fspath(path)))

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.processor.encode(text, out_type=int)]

    def decode(self, ids: TokenIds) -> str:
        return self.processor.decode(
            [i for i in int_ids(ids, self.vocab_size) if i not in self._skip]
        )

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"
