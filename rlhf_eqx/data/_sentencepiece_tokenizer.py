"""Sentencepiece models (`.model`) as tokenizers."""

import os
from collections.abc import Sequence

from ._errors import DataError
from ._hf_tokenizer import (
    _chat_template as hf_chat_template,
    carried_chat_template,
    end_ids,
    generation_stop_ids,
    tokenizer_config,
)
from ._tokenizer import TokenIds, int_ids


class SentencePieceTokenizer:
    """A sentencepiece model (`.model`, e.g. Llama 1/2, Mistral, Gemma).

    BOS/EOS/padding are the model's own ids; a model without a padding piece pads with
    the unknown-piece id (padding is always masked). `decode` skips BOS, EOS and the
    padding piece (when the model has one). `chat_template` and `add_bos_token` are a
    Hugging Face directory's (`tokenizer_config.json` or `chat_template.jinja` beside
    the file, read by `from_file`: the model's chat template, `jinja_chat_template()`
    rendering it); without them, no template and BOS first (the sentencepiece models'
    convention). `stop_ids`: EOS, then the end-of-turn ids of a Hugging Face directory's
    `generation_config.json` (or `config.json`) `eos_token_id` list beside the file.
    """

    def __init__(
        self,
        processor,
        *,
        chat_template: str | None = None,
        add_bos_token: bool = True,
        stop_ids: Sequence[int] = (),
    ):
        self.processor = processor
        self.chat_template: str | None = chat_template
        self.add_bos_token: bool = bool(add_bos_token)
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
        self.stop_ids: tuple[int, ...] = end_ids(self.eos_id, stop_ids, self.vocab_size)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        import sentencepiece as spm

        path = os.fspath(path)
        directory = os.path.dirname(path)
        config = tokenizer_config(directory)
        add_bos = config.get("add_bos_token")
        processor = spm.SentencePieceProcessor(model_file=path)
        return cls(
            processor,
            chat_template=hf_chat_template(config, directory),
            add_bos_token=True if add_bos is None else bool(add_bos),
            stop_ids=generation_stop_ids(directory, int(processor.get_piece_size())),
        )

    def token(self, i: int) -> str:
        """The piece of id `i` (e.g. `"<s>"`)."""
        return str(self.processor.id_to_piece(int(i)))

    def jinja_chat_template(self):
        """The `chat_template` as a `JinjaChatTemplate` with this tokenizer's BOS and EOS
        pieces; a `DataError` when there is none."""
        return carried_chat_template(self)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.processor.encode(text, out_type=int)]

    def decode(self, ids: TokenIds) -> str:
        return self.processor.decode(
            [i for i in int_ids(ids, self.vocab_size) if i not in self._skip]
        )

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"
