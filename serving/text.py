"""Tokenization for the embedding model, shared by the service front and the pipeline."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from serving.errors import EmptyInput, InputTooLarge, InvalidInput

# A long text is tokenized from its head, about this many characters a token (cut at a space),
# when that head already gives the model all the tokens it takes: a 3.5 MB text sent to be
# truncated cost 2 s of tokenizing (answered 503, its deadline spent) for the 256 tokens kept.
CHARS_PER_TOKEN = 16


class TextTokenizer:
    """Turns texts into unpadded token ids; padding happens once per batch, in the model worker."""

    def __init__(self, tokenizer_file: Path, *, max_length: int) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.max_length = max_length
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0

    def encode(self, texts: list[str], *, truncate: bool, first_index: int = 0) -> list[list[int]]:
        """`first_index`: the position of `texts[0]` in the request, for error messages."""
        for index, text in enumerate(texts, start=first_index):
            if not text.strip():
                raise InvalidInput(f"texts[{index}] is empty")
        heads = [self._head(text) for text in texts]
        encodings = self.tokenizer.encode_batch(heads)
        for i, (text, head) in enumerate(zip(texts, heads, strict=True)):
            if len(head) < len(text) and len(encodings[i].ids) <= self.max_length:
                encodings[i] = self.tokenizer.encode(text)  # a head that did not reach the limit: all of it
        for index, encoding in enumerate(encodings, start=first_index):
            if all(encoding.special_tokens_mask):
                raise InvalidInput(f"texts[{index}] has nothing the model reads: only characters its tokenizer drops")
        ids = [encoding.ids for encoding in encodings]
        if truncate:
            return [_truncate(e.ids, e.special_tokens_mask, self.max_length) for e in encodings]
        for index, (row, text, head) in enumerate(zip(ids, texts, heads, strict=True), start=first_index):
            if len(row) > self.max_length:
                counted = f"more than {self.max_length}" if len(head) < len(text) else f"{len(row)}"
                raise InputTooLarge(
                    f"texts[{index}] has {counted} tokens; the model takes at most "
                    f"{self.max_length} (send truncate=true to cut it)"
                )
        return ids

    def _head(self, text: str) -> str:
        """The text's first `CHARS_PER_TOKEN` × `max_length` characters, cut at a space where one
        is in their second half, so that every word in it is whole and tokenized as in the text."""
        limit = CHARS_PER_TOKEN * self.max_length
        if len(text) <= limit:
            return text
        space = text.rfind(" ", limit // 2, limit)
        return text[: space if space > 0 else limit]


def _truncate(ids: list[int], special: list[int], max_length: int) -> list[int]:
    """The text's tokens cut, the special tokens its tokenizer ends it with kept ([SEP], </s>, or
    none), as the tokenizer's own truncation and sentence-transformers cut it."""
    if len(ids) <= max_length:
        return ids
    closing = len(special) - len(bytes(special).rstrip(b"\x01"))
    return ids[: max_length - closing] + ids[len(ids) - closing :]


def check_text_batch(texts: list[str], *, max_items: int) -> None:
    if not texts:
        raise EmptyInput("texts is empty: send at least one text")
    if len(texts) > max_items:
        raise InputTooLarge(f"texts has {len(texts)} items; the limit per request is {max_items}")


def pad_batch(
    rows: list[list[int]], pad_id: int, *, length_multiple: int = 1, max_length: int | None = None
) -> dict[str, np.ndarray]:
    """Right-pad to the longest row of this batch, not to the model maximum: rounded up to
    `length_multiple` (an engine that compiles kernels per shape, serving/engine.py), never
    past `max_length`."""
    longest = max(len(row) for row in rows)
    rounded = -(-longest // length_multiple) * length_multiple
    longest = max(longest, min(rounded, max_length or rounded))
    input_ids = np.full((len(rows), longest), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# Padding a merged batch to its longest row costs compute on every padded position. On CPUs,
# where a transformer's cost is nearly proportional to the tokens it runs and one more engine
# call costs little, mixed-length texts are better run in groups of similar length. Measured on
# 2 cores (MiniLM-L6 INT8, random sets of the 64 sample texts, 6-174 tokens), ms per text:
# sets of 4: padded 8.1-10.7, one by one 6.3-6.4, grouped 5.7-5.9; sets of 8: padded 12.5-13.5,
# one by one 7.0-7.3, grouped 5.9-6.9.
MAX_PADDING = 0.25


def length_groups(lengths: list[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Row indices in groups of similar length, shortest first, each padding at most
    `max_padding` of its real tokens; a group of one row never pads."""
    groups: list[list[int]] = []
    tokens = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        longest = lengths[index]  # ascending order: the newest row is the group's longest
        if groups and longest * (len(groups[-1]) + 1) <= (1 + max_padding) * (tokens + longest):
            groups[-1].append(index)
            tokens += longest
        else:
            groups.append([index])
            tokens = longest
    return groups


def padded_tokens(lengths: list[int]) -> int:
    """Token positions the engine runs for rows of these lengths, padding of their length groups included."""
    return sum(len(group) * max(lengths[i] for i in group) for group in length_groups(lengths))


def padded_tokens_bound(rows: int, longest: int, total: int) -> int:
    """An upper bound of `padded_tokens` from running figures alone (the batcher adds rows one at a
    time): no more than padding every row to the longest, nor than `MAX_PADDING` over the real tokens."""
    return min(rows * longest, math.ceil(total * (1 + MAX_PADDING)))
