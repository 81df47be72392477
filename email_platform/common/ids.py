"""ULID event ids: 48-bit millisecond time + 80 random bits, Crockford base32, 26 characters.

Sortable by creation time, so the outbox can be read oldest-first by id, yet the send path never
relies on that order alone (a row committed late with an earlier id is still sent).
"""

import os
import time

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_ulid(timestamp_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def is_ulid(value: str) -> bool:
    return len(value) == 26 and all(c in _ALPHABET for c in value.upper())
