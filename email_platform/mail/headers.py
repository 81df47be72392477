"""What may reach a mail header: no line break, before or after RFC 2047 decoding.

A header value that holds CR or LF can end the header and start another (``Bcc:``) or the body.
Checking for raw CR/LF is not enough: mail libraries decode RFC 2047 encoded words
(``=?utf-8?q?Jane=0D=0ABcc:...?=``) when they parse a header and may write the decoded line
break on the wire, and whether they do depends on the library's version. So every value bound
for a header is checked here in both forms, the same way at ``publish()``, after rendering, and
in the adapters, and refused if either form holds a line separator or another control
character. No library's behaviour is relied on.
"""

import re
from collections.abc import Iterable
from email.errors import HeaderParseError
from email.header import decode_header
from email.policy import default as _modern_policy

#: CR, LF, NUL, the other C0 controls but tab, DEL, NEL and the Unicode line/paragraph
#: separators: any of them can end a line for some mail system.
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")


#: Encoded words inside encoded words are decoded again, this many levels deep.
_MAX_DECODE_LEVELS = 4


def _decodings(value: str) -> list[str]:
    """``value`` as each of the standard library's two header parsers decodes it, repeatedly."""
    found: list[str] = []
    current = [value]
    for _ in range(_MAX_DECODE_LEVELS):
        following = []
        for text in current:
            for decoded in (_legacy_decoded(text), _modern_decoded(text)):
                if decoded != text and decoded not in found:
                    found.append(decoded)
                    following.append(decoded)
        if not following:
            break
        current = following
    return found


def _modern_decoded(value: str) -> str:
    try:
        return str(_modern_policy.header_factory("Subject", value))
    except Exception:  # the parser's defects are not ours to raise; the legacy form still runs
        return value


def _legacy_decoded(value: str) -> str:
    """``value`` with every RFC 2047 encoded word decoded (undecodable bytes replaced)."""
    try:
        parts = decode_header(value)
    except (HeaderParseError, ValueError, LookupError):
        return value
    decoded: list[str] = []
    for part, charset in parts:
        if isinstance(part, bytes):
            try:
                decoded.append(part.decode(charset or "ascii", errors="replace"))
            except (LookupError, UnicodeError, TypeError, ValueError):
                # An unknown charset, or a codec that refuses errors="replace" (idna,
                # punycode): read the bytes as Latin-1, which maps every byte.
                decoded.append(part.decode("latin-1"))
        else:
            decoded.append(part)
    return "".join(decoded)


def all_safe(values: Iterable[str]) -> bool:
    """Whether ``unsafe_header_reason`` passes every one of ``values``, checked in one scan.

    A space joins them: it is safe itself and splits an ``=?`` across two values, so the joined
    text holds an unsafe character or an encoded word only where one of the values does.
    """
    joined = " ".join(values)
    if "=?" in joined:
        return False
    # Every character _UNSAFE matches is unprintable: a printable text (most) needs no search.
    return joined.isprintable() or _UNSAFE.search(joined) is None


def unsafe_header_reason(value: str) -> str | None:
    """Why ``value`` may not go into a header, or ``None`` if it may."""
    match = _UNSAFE.search(value)
    if match is not None:
        return f"contains {_name(match.group())}, which would inject mail headers"
    if "=?" in value:
        for decoded in _decodings(value):
            match = _UNSAFE.search(decoded)
            if match is not None:
                return (
                    f"contains an RFC 2047 encoded {_name(match.group())}, which would inject "
                    "mail headers once decoded"
                )
    return None


def _name(character: str) -> str:
    return {"\r": "CR", "\n": "LF", "\x00": "NUL"}.get(character, f"U+{ord(character):04X}")
