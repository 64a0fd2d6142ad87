"""UTF-8 bytes as tokens: a tokenizer with no files and no dependencies."""

from ._tokenizer import TokenIds, int_ids


class ByteTokenizer:
    """UTF-8 bytes as tokens; no files, no dependencies.

    Ids: padding 0, BOS 1, EOS 2, byte `b` → `b + 3` (the same layout as llama2.c's
    byte-fallback pieces); `vocab_size` = 259. Decoding replaces invalid UTF-8 and
    refuses (`DataError`) an id that is not an integer in `[0, 259)`.
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    vocab_size: int = 259
    stop_ids: tuple[int, ...] = (2,)  # EOS

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8", errors="surrogatepass")]

    def decode(self, ids: TokenIds) -> str:
        kept = [i for i in int_ids(ids, self.vocab_size) if i >= 3]
        return bytes(i - 3 for i in kept).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
