"""The SMTP adapter's message as it goes on the wire: headers written byte for byte here, the
body in the transfer encoding the server can take.

The standard library's header folder is not used for our headers: below Python 3.13 it turns
any header with a word too long for a 78-character line into RFC 2047 encoded words (a
``List-Unsubscribe`` link, a long ``X-Email-Idempotency-Key``), which mail clients do not
decode in such fields, and it loses a space when it splits a non-ASCII subject across encoded
words. So:

- a header whose value is ASCII is folded at whitespace only (a CRLF put before an existing
  space, so unfolding gives the value back exactly) or not at all; a word longer than a line
  stays whole, up to RFC 5322's 998 characters;
- ``Subject``, display names and custom headers holding non-ASCII text become encoded words
  built here, ``=?utf-8?q?…?=``, each within 75 characters, split only between code points,
  with every space inside a word: decoders drop the whitespace between two encoded words, so
  nothing is lost;
- headers that carry identifiers or URLs (``X-Email-*``, ``List-*``, ``Message-ID``...) are never
  encoded words; non-ASCII there can only travel as UTF-8 (RFC 6532), so it needs SMTPUTF8;
- domains are written as A-labels (IDNA: ``bücher.example.com`` -> ``xn--bcher-kva.example.com``)
  in the envelope and the headers; a non-ASCII local part needs SMTPUTF8 (RFC 6531).

Bodies: text without 8-bit characters is ``7bit``; 8-bit text is ``8bit`` only where the server
offered 8BITMIME (the transaction then says ``BODY=8BITMIME``), quoted-printable otherwise (RFC
6152 forbids 8-bit data to a server that did not offer it); a line longer than SMTP allows is
always quoted-printable.
"""

import re
from collections.abc import Iterator, Sequence
from email.errors import HeaderParseError
from email.headerregistry import Address
from email.message import EmailMessage
from email.policy import SMTP as SMTP_POLICY

import idna

from email_platform.common.errors import PermanentError
from email_platform.mail.addressing import Attachment

#: Lines SHOULD stay within 78 characters and MUST within 998 (RFC 5322 2.1.1).
LINE_SHOULD = 78
LINE_MUST = 998
#: RFC 2047: an encoded word is at most 75 characters.
_WORD_MAX = 75
_WORD_OPEN, _WORD_CLOSE = "=?utf-8?q?", "?="
#: Characters an encoded word may hold as themselves in any header position (RFC 2047 5(3)).
_Q_LITERAL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789!*+-/")
#: Headers holding identifiers or URLs, read by machines that do not decode encoded words.
_NEVER_ENCODED = ("x-email-", "list-", "message-id", "in-reply-to", "references")
_PIECE = re.compile(r"[ \t]*[^ \t]+[ \t]*$|[ \t]*[^ \t]+|[ \t]+$")
_UTF8_ATOM = r"(?:[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]|[^\x00-\x7f])+"
_UTF8_DOT_ATOM = re.compile(rf"{_UTF8_ATOM}(?:\.{_UTF8_ATOM})*")
_ATOM_TEXT = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~ -]*")


def never_encoded(name: str) -> bool:
    return name.lower().startswith(_NEVER_ENCODED)


def wire_address(address: str, role: str) -> tuple[str, str | None]:
    """``address`` with its domain as A-labels, and why it needs SMTPUTF8 (or None)."""
    local, at, domain = address.rpartition("@")
    if not at or not local or not domain:
        raise PermanentError(f"{role} {address!r} is not an address", code="invalid_address")
    if not domain.isascii():
        try:
            domain = idna.encode(domain, uts46=True).decode("ascii")
        except idna.IDNAError as exc:
            raise PermanentError(
                f"{role} {address!r}: {domain!r} is not a valid internationalized domain "
                f"name ({exc})",
                code="invalid_address",
            ) from exc
    # Python's address parser refuses a non-ASCII local part (RFC 6531 allows it): that one is
    # checked as a dot-atom here and the parser sees an ASCII stand-in for it.
    utf8 = None
    if not local.isascii():
        if not _UTF8_DOT_ATOM.fullmatch(local):
            raise PermanentError(
                f"{role} {address!r}: the local part is not a valid address", code="invalid_address"
            )
        utf8 = f"{role} {address!r} has a non-ASCII local part"
    try:
        parsed = Address(addr_spec=f"{local if utf8 is None else 'x'}@{domain}")
    except (ValueError, IndexError, HeaderParseError) as exc:
        raise PermanentError(
            f"{role} {address!r} is not a usable address: {exc}", code="invalid_address"
        ) from exc
    return (parsed.addr_spec if utf8 is None else f"{local}@{domain}"), utf8


def encoded_words(text: str, first_budget: int) -> list[str]:
    """``text`` as encoded words; the first fits ``first_budget`` characters, the others a
    continuation line (a leading space); words split only between code points."""
    words: list[str] = []
    current: list[str] = []
    size = 0
    budget = min(first_budget, _WORD_MAX) - len(_WORD_OPEN) - len(_WORD_CLOSE)
    for char in text:
        if char in _Q_LITERAL:
            piece = char
        elif char == " ":
            piece = "_"
        else:
            piece = "".join(f"={byte:02X}" for byte in char.encode("utf-8"))
        if current and size + len(piece) > budget:
            words.append(_WORD_OPEN + "".join(current) + _WORD_CLOSE)
            current, size = [], 0
            budget = min(LINE_SHOULD - 1, _WORD_MAX) - len(_WORD_OPEN) - len(_WORD_CLOSE)
        current.append(piece)
        size += len(piece)
    words.append(_WORD_OPEN + "".join(current) + _WORD_CLOSE)
    return words


def fold(name: str, value: str) -> str | None:
    """``Name: value`` folded at whitespace (CRLF before an existing space or tab), or None
    when a line would exceed 998 octets."""
    lines = [f"{name}: "]
    for piece in _PIECE.findall(value):
        if len(lines[-1]) + len(piece) > LINE_SHOULD and lines[-1].strip() and piece[0] in " \t":
            lines.append(piece)
        else:
            lines[-1] += piece
    if any(len(line.encode("utf-8")) > LINE_MUST for line in lines):
        return None
    return "\r\n".join(lines) + "\r\n"


def unstructured(name: str, value: str) -> str:
    """A text header (Subject, a custom header): as itself where it is plain ASCII, else
    encoded words that decode to exactly ``value``."""
    if value.isascii():  # an encoded word the route wrote itself stays one, as it meant
        folded = fold(name, value)
        if folded is not None:
            return folded
    words = encoded_words(value, LINE_SHOULD - len(name) - 2)
    return f"{name}: " + "\r\n ".join(words) + "\r\n"


def phrase(display_name: str, first_budget: int) -> str:
    """A display name as an RFC 5322 phrase: atoms, a quoted string, or encoded words."""
    if display_name.isascii():
        if _ATOM_TEXT.fullmatch(display_name) and display_name.strip() == display_name:
            return display_name
        escaped = display_name.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    return "\r\n ".join(encoded_words(display_name, first_budget))


def address_list(name: str, entries: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """An address-list header (``Cc``, ``Reply-To``) of ``(display name, wire address)``
    pairs: its unfolded value and its lines, one address a line."""
    budget = LINE_SHOULD - len(name) - 2
    shown = [f"{d} <{a}>" if d else a for d, a in entries]
    parts = [f"{phrase(d, budget)} <{a}>" if d else a for d, a in entries]
    return ", ".join(shown), f"{name}: " + ",\r\n ".join(parts) + "\r\n"


class SmtpMessage:
    """Headers in order, both bodies, the envelope, and what (if anything) needs SMTPUTF8."""

    def __init__(self, envelope_from: str, envelope_to: str, text: str, html: str | None) -> None:
        self.envelope_from = envelope_from
        self.envelope_to = envelope_to
        self.text = text
        self.html = html
        self._values: dict[str, str] = {}  # lower-cased name -> unfolded value
        self._lines: list[str] = []
        #: Why the message needs SMTPUTF8, or None (the first reason found).
        self.smtputf8_reason: str | None = None
        #: Cc and Bcc addresses: more ``RCPT TO``s after ``envelope_to``.
        self.extra_recipients: list[str] = []
        self.attachments: Sequence[Attachment] = ()

    def __getitem__(self, name: str) -> str | None:
        return self._values.get(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values

    def needs_smtputf8(self, reason: str | None) -> None:
        if reason is not None and self.smtputf8_reason is None:
            self.smtputf8_reason = reason

    def add_raw(self, name: str, value: str, line: str) -> None:
        self._values[name.lower()] = value
        self._lines.append(line)

    def add(self, name: str, value: str) -> None:
        """A header by the rules of the module docstring."""
        if not never_encoded(name):
            self.add_raw(name, value, unstructured(name, value))
            return
        line = fold(name, value)
        if line is None:
            raise PermanentError(
                f"header {name!r} holds a word too long for an SMTP line ({LINE_MUST} octets)",
                code="invalid_header",
            )
        if not value.isascii():
            self.needs_smtputf8(
                f"header {name!r} holds non-ASCII text, which it can only carry as UTF-8 (RFC 6532)"
            )
        self.add_raw(name, value, line)

    @property
    def has_8bit_body(self) -> bool:
        return any(_cte(part, eight_bit=True) == "8bit" for part in self._parts())

    def as_bytes(self, *, eight_bit: bool) -> bytes:
        """The message; 8-bit body parts only if ``eight_bit`` (the server offered 8BITMIME)."""
        body = EmailMessage(policy=SMTP_POLICY)
        body.set_content(self.text, cte=_cte(self.text, eight_bit=eight_bit))
        if self.html is not None:
            body.add_alternative(
                self.html, subtype="html", cte=_cte(self.html, eight_bit=eight_bit)
            )
        if self.attachments:  # multipart/mixed: the alternative, then each file (base64)
            body.make_mixed()
            for attachment in self.attachments:
                maintype, _, subtype = attachment.content_type.partition("/")
                body.add_attachment(
                    attachment.content,
                    maintype=maintype,
                    subtype=subtype,
                    filename=attachment.filename,
                )
        # The MIME headers (MIME-Version, Content-Type, Content-Transfer-Encoding) are short
        # ASCII: the library writes them and the body.
        return "".join(self._lines).encode("utf-8") + body.as_bytes(policy=SMTP_POLICY)

    def _parts(self) -> Iterator[str]:
        yield self.text
        if self.html is not None:
            yield self.html


def _cte(text: str, *, eight_bit: bool) -> str:
    longest = max((len(line.encode("utf-8")) for line in text.splitlines()), default=0)
    if longest > LINE_MUST - 2:  # no line this long may go out as itself
        return "quoted-printable"
    if text.isascii():
        return "7bit"
    return "8bit" if eight_bit else "quoted-printable"
