"""Text columns: a BPE tokenizer fitted on the train split, and texts -> fixed-width token ids.

The `tokenizers` library (Rust, the Hugging Face tokenizers) does the fitting and encoding.
BPE rather than WordPiece: with tokenizers 0.23.3, two WordPiece fits of the same texts gave
different token ids (measured), and a content-addressed preprocessing step must fit the same
tokenizer wherever it runs; two BPE fits gave identical tokenizers.

Every sequence starts with [CLS], so it has at least one real token (an all-masked attention
row would give NaN), and the model may pool on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from training.data.ingest.ragged import Ragged

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["PAD", "CLS", "fit_tokenizer", "TextEncoder", "tokenizers_version"]

PAD, UNK, CLS = "[PAD]", "[UNK]", "[CLS]"
PAD_ID = 0


def tokenizers_version() -> str:
    import tokenizers

    return str(tokenizers.__version__)


def fit_tokenizer(texts: Iterable[str], vocab_size: int) -> str:
    """A BPE tokenizer fitted on `texts`, as its JSON."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, UNK, CLS], show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return str(tokenizer.to_str())


class TextEncoder:
    """Texts -> (token ids (rows, max_tokens), lengths (rows,)); picklable (the tokenizer is
    rebuilt from its JSON in each process)."""

    def __init__(self, tokenizer_json: str, max_tokens: int) -> None:
        self.tokenizer_json = tokenizer_json
        self.max_tokens = max_tokens
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_tokenizer": None}

    @property
    def vocab_size(self) -> int:
        return int(self._get().get_vocab_size())

    def _get(self) -> Tokenizer:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(self.tokenizer_json)
            # [CLS] is prepended by hand below: room for it.
            tokenizer.enable_truncation(self.max_tokens - 1)
            self._tokenizer = tokenizer
        return self._tokenizer

    def id_dtype(self) -> type:
        return np.uint16 if self.vocab_size <= 1 << 16 else np.int32

    def encode(self, texts: Ragged) -> tuple[np.ndarray, np.ndarray]:
        tokenizer = self._get()
        cls_id = tokenizer.token_to_id(CLS)
        encodings = tokenizer.encode_batch(texts.texts(), add_special_tokens=False)
        ids: np.ndarray = np.full((len(texts), self.max_tokens), PAD_ID, dtype=self.id_dtype())
        lengths = np.empty(len(texts), dtype=np.int16 if self.max_tokens < 1 << 15 else np.int32)
        ids[:, 0] = cls_id
        for i, encoding in enumerate(encodings):
            row = encoding.ids
            ids[i, 1: 1 + len(row)] = row
            lengths[i] = 1 + len(row)
        return ids, lengths
