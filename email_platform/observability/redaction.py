"""Finding one person's address in free text, and taking it out.

Erasure uses it to tell which rows mention an address and to scrub error texts it keeps; the
send path uses it so its log lines (which Dagster stores in the run's event log, beyond
erasure's reach) never carry an address.
"""

import re
from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import unquote

ERASED = "[erased]"
#: Characters that would make it a longer address: one is only "mentioned" where none of
#: these touches it, so ``zelda@example.org`` is not found inside ``xzelda@example.org``. The
#: rarer characters a local part may hold (``/``, ``=``, ``?``, ...) count as separators, as
#: they are in URLs (``/u/zelda@...``, ``?email=zelda@...``).
_LOCAL_CHARS = r"A-Za-z0-9._+-"
#: Anything shaped like an address (IDN domains included), for log lines of unknown content.
_ADDRESS_LIKE = re.compile(r"[^\s@<>()\[\]{}\"',;:]+@[^\s@<>()\[\]{}\"',;:]+")
#: A local part shorter than this is not scrubbed on its own: it would match ordinary words.
_MIN_TERM = 3


def local_parts(address: str) -> list[str]:
    """The local part, and its base without a ``+tag`` when it has one, lowercased."""
    local = address.strip().lower().rpartition("@")[0]
    parts = [local]
    base = local.split("+", 1)[0]
    if base and base != local:
        parts.append(base)
    return [part for part in parts if len(part) >= _MIN_TERM]


@lru_cache(maxsize=256)
def _address_pattern(address: str) -> re.Pattern[str]:
    return re.compile(
        rf"(?<![{_LOCAL_CHARS}]){re.escape(address)}(?![A-Za-z0-9-]|\.[A-Za-z0-9-])", re.IGNORECASE
    )


@lru_cache(maxsize=256)
def _term_pattern(term: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(term)}(?![A-Za-z0-9])", re.IGNORECASE)


def mentions(text: str, address: str) -> bool:
    """Whether ``text`` holds ``address`` (any case), as it is or percent-encoded (a URL)."""
    pattern = _address_pattern(address.strip().lower())
    return bool(pattern.search(text)) or ("%" in text and bool(pattern.search(unquote(text))))


def scrub(text: str | None, addresses: Iterable[str]) -> str | None:
    """``text`` with each address, and each local part of it, replaced by ``[erased]``."""
    if not text:
        return text
    for address in addresses:
        address = address.strip().lower()
        text = _address_pattern(address).sub(ERASED, text)
        if "%" in text and _address_pattern(address).search(unquote(text)):
            text = _address_pattern(address).sub(ERASED, unquote(text))
        for term in local_parts(address):
            text = _term_pattern(term).sub(ERASED, text)
    return text


def loggable(text: str, recipient: str | None = None) -> str:
    """``text`` fit for a log line: the recipient's address and local part, and anything else
    shaped like an address, replaced (provider errors often quote the address they refused)."""
    if recipient:
        text = scrub(text, [recipient]) or text
    return _ADDRESS_LIKE.sub("[address]", text)
