"""Who a route's mail is from and to whom else it goes, and the files it carries.

A route names its ``From`` (``sender``), ``Reply-To``, ``Cc`` and ``Bcc`` as ``Mailbox`` specs
(a fixed address, or a payload field, each with an optional display name, fixed or from the
payload), an envelope sender (the SMTP bounce address, fixed), and an attachment function run
at send time (the attachment is never stored in the outbox). ``publish()`` checks the payload
fields these read (``check_payload``) as it checks the recipient; the send path resolves them
(``address``, ``attachments_for``), and a failure there is a ``PermanentError`` naming the
cause, which dead-letters that message alone. ``refuse_uncarried`` stops a run at start-up
whose adapter cannot carry what a route asks for.
"""

import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from email.utils import parseaddr
from typing import Any, Protocol

from email_platform.common.errors import ConfigurationError, PermanentError, PublishError
from email_platform.publishing.validation import check_address, check_no_line_breaks

#: A display name: one line, at most this long.
MAX_NAME_LENGTH = 200
#: How many Reply-To, Cc and Bcc addresses a route may have together (providers cap Cc+Bcc at
#: 50 for Postmark and Resend; the rest are far above).
MAX_EXTRA_ADDRESSES = 50
#: Default attachment limits: 10 files, 7 MiB in all, so the base64 the HTTP APIs take (4/3 of
#: it) stays within Postmark's 10 MB message limit, the smallest of the providers'.
DEFAULT_MAX_ATTACHMENTS = 10
DEFAULT_MAX_ATTACHMENT_BYTES = 7 * 1024 * 1024
MAX_FILENAME_LENGTH = 150
_TOKEN = r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
#: ``type/subtype`` as RFC 6838 names them, without parameters.
_CONTENT_TYPE = re.compile(rf"{_TOKEN}/{_TOKEN}")
#: The features ``refuse_uncarried`` checks, by the ``Route`` field that asks for them.
FEATURES = ("reply_to", "cc", "bcc", "envelope_sender", "attachments")


def check_display_name(field: str, value: Any) -> str:
    """A display name a header can carry: one printable line, no angle brackets (which would
    make ``Name <addr>`` read as another address), at most ``MAX_NAME_LENGTH``."""
    if not isinstance(value, str):
        raise PublishError(field, "must be a string")
    check_no_line_breaks(field, value)
    if len(value) > MAX_NAME_LENGTH:
        raise PublishError(field, f"is {len(value)} characters; at most {MAX_NAME_LENGTH} fit")
    if not value.isprintable() or "<" in value or ">" in value or "\\" in value:
        raise PublishError(field, "must be printable text without < > or \\")
    if "=?" in value:
        raise PublishError(field, "holds '=?', which mail readers decode as an encoded word")
    return value


@dataclass(frozen=True)
class Mailbox:
    """One address of a route's mail: ``address`` fixed or read from ``address_field`` of the
    payload; the display name read from ``name_field`` when the payload has it, else ``name``."""

    address: str | None = None
    name: str | None = None
    address_field: str | None = None
    name_field: str | None = None

    def __post_init__(self) -> None:
        if (self.address is None) == (self.address_field is None):
            raise ConfigurationError("a Mailbox needs exactly one of address and address_field")
        try:
            if self.address is not None:
                check_address("address", self.address)
            if self.name is not None:
                check_display_name("name", self.name)
        except PublishError as error:
            raise ConfigurationError(f"Mailbox {error}") from None

    @classmethod
    def parse(cls, value: str) -> "Mailbox":
        """A fixed mailbox from ``"Name <addr>"`` or ``"addr"``."""
        name, address = parseaddr(value)
        return cls(address=address or value, name=name or None)

    def check_payload(self, payload: Mapping[str, Any], what: str) -> None:
        """What ``publish()`` refuses: a missing or invalid address, a name that is not one."""
        if self.address_field is not None:
            if self.address_field not in payload:
                raise PublishError(f"payload.{self.address_field}", f"is required ({what})")
            check_address(f"payload.{self.address_field}", payload[self.address_field])
        if self.name_field is not None and payload.get(self.name_field) is not None:
            check_display_name(f"payload.{self.name_field}", payload[self.name_field])

    def resolve(self, payload: Mapping[str, Any], what: str) -> str:
        """``Name <addr>`` (the name quoted when it must be) or ``addr``; checked again, as a
        payload published before these checks (or an upcaster's output) may not pass them."""
        try:
            self.check_payload(payload, what)
        except PublishError as error:
            raise PermanentError(f"{what}: {error}", code="invalid_address") from None
        address = self.address if self.address is not None else payload[self.address_field or ""]
        name = payload.get(self.name_field) if self.name_field else None
        return mailbox_text(address, name or self.name)


def mailbox_text(address: str, name: str | None) -> str:
    """``addr`` or ``Name <addr>``; a name with specials is a quoted string (``parseaddr``, which
    every adapter reads it with, gives the name back)."""
    if not name:
        return address
    if re.fullmatch(r"[\w' -]+", name) and name.strip() == name:
        return f"{name} <{address}>"
    return '"' + name.replace('"', '\\"') + f'" <{address}>'


@dataclass(frozen=True)
class Attachment:
    """One file a message carries: made at send time, never stored."""

    filename: str
    content_type: str
    content: bytes


class AttachmentMaker(Protocol):
    def __call__(self, payload: Mapping[str, Any], /) -> Sequence[Attachment]: ...


@dataclass(frozen=True)
class AttachmentLimits:
    """At most ``max_count`` files of ``max_total_bytes`` in all, per message."""

    max_count: int = DEFAULT_MAX_ATTACHMENTS
    max_total_bytes: int = DEFAULT_MAX_ATTACHMENT_BYTES

    def __post_init__(self) -> None:
        if self.max_count < 0 or self.max_total_bytes < 0:
            raise ConfigurationError("attachment limits cannot be negative")


@dataclass(frozen=True)
class Addressed:
    """A route's addresses resolved for one message."""

    sender: str
    reply_to: tuple[str, ...] = ()
    cc: tuple[str, ...] = ()
    bcc: tuple[str, ...] = ()
    envelope_sender: str | None = None


class _Addressing(Protocol):
    """What of a ``Route`` this module reads (``routes`` imports this module)."""

    name: str
    sender: Mailbox | None
    reply_to: tuple[Mailbox, ...]
    cc: tuple[Mailbox, ...]
    bcc: tuple[Mailbox, ...]
    envelope_sender: str | None
    attachments: Callable[[Mapping[str, Any]], Sequence[Attachment]] | None
    attachment_limits: AttachmentLimits


def _mailboxes(route: _Addressing) -> Iterable[tuple[str, Mailbox]]:
    if route.sender is not None:
        yield "sender", route.sender
    for role in ("reply_to", "cc", "bcc"):
        for box in getattr(route, role):
            yield role, box


def check_route(route: _Addressing) -> None:
    """A route's own settings: a ``ConfigurationError`` naming the route and field (``Route``
    calls it when it is made)."""
    for role in ("reply_to", "cc", "bcc"):
        value = getattr(route, role)
        if not isinstance(value, tuple) or not all(isinstance(b, Mailbox) for b in value):
            raise ConfigurationError(f"route {route.name}: {role} must be a tuple of Mailbox")
    if route.sender is not None and not isinstance(route.sender, Mailbox):
        raise ConfigurationError(f"route {route.name}: sender must be a Mailbox")
    if len(route.reply_to) + len(route.cc) + len(route.bcc) > MAX_EXTRA_ADDRESSES:
        raise ConfigurationError(
            f"route {route.name}: more than {MAX_EXTRA_ADDRESSES} Reply-To, Cc and Bcc addresses"
        )
    if route.envelope_sender is not None:
        try:
            check_address("envelope_sender", route.envelope_sender)
        except PublishError as error:
            raise ConfigurationError(f"route {route.name}: {error}") from None


def check_payload(route: _Addressing, payload: Mapping[str, Any]) -> None:
    """``publish()``'s check of the payload fields the route's addresses read (the route's own
    settings were checked when it was made: ``check_route``)."""
    for role, box in _mailboxes(route):
        box.check_payload(payload, f"route {route.name}'s {role}")


def address(route: _Addressing, payload: Mapping[str, Any], default_sender: str) -> Addressed:
    """The route's addresses for ``payload``; ``PermanentError`` (``invalid_address``) naming
    the field when one is not an address."""
    sender = route.sender.resolve(payload, "sender") if route.sender else default_sender
    return Addressed(
        sender=sender,
        reply_to=tuple(b.resolve(payload, "reply_to") for b in route.reply_to),
        cc=tuple(b.resolve(payload, "cc") for b in route.cc),
        bcc=tuple(b.resolve(payload, "bcc") for b in route.bcc),
        envelope_sender=route.envelope_sender,
    )


def attachments_for(route: _Addressing, payload: Mapping[str, Any]) -> tuple[Attachment, ...]:
    """The route's attachments for ``payload``, checked; whatever goes wrong is a
    ``PermanentError`` naming it: ``attachment_failed`` (the function raised or returned
    something else), ``attachment_invalid``, ``attachments_too_many``,
    ``attachments_too_large``."""
    if route.attachments is None:
        return ()
    try:
        made = list(route.attachments(payload))
    except Exception as exc:  # the route's code: whatever it raises, this message alone dies
        raise PermanentError(
            f"route {route.name}'s attachment function failed: {type(exc).__name__}: {exc}",
            code="attachment_failed",
        ) from None
    limits = route.attachment_limits
    if len(made) > limits.max_count:
        raise PermanentError(
            f"route {route.name} made {len(made)} attachments; at most {limits.max_count}",
            code="attachments_too_many",
        )
    checked = tuple(_checked(route.name, item) for item in made)
    total = sum(len(a.content) for a in checked)
    if total > limits.max_total_bytes:
        raise PermanentError(
            f"route {route.name}'s attachments are {total} bytes; at most {limits.max_total_bytes}",
            code="attachments_too_large",
        )
    return checked


def _checked(route_name: str, item: Any) -> Attachment:
    if not isinstance(item, Attachment):
        raise PermanentError(
            f"route {route_name}'s attachment function returned a {type(item).__name__}, "
            "not an Attachment",
            code="attachment_failed",
        )
    content = item.content
    if isinstance(content, bytearray | memoryview):
        content = bytes(content)
    if not isinstance(content, bytes):
        raise PermanentError(
            f"route {route_name}: attachment content is a {type(content).__name__}, not bytes",
            code="attachment_invalid",
        )
    if not isinstance(item.content_type, str) or not _CONTENT_TYPE.fullmatch(item.content_type):
        raise PermanentError(
            f"route {route_name}: attachment type {item.content_type!r} is not type/subtype",
            code="attachment_invalid",
        )
    return Attachment(safe_filename(item.filename), item.content_type.lower(), content)


def safe_filename(name: Any) -> str:
    """A file name every adapter can carry: path separators, control and format characters
    (CR, LF, NUL, bidi overrides) and quotes replaced by ``_``, at most
    ``MAX_FILENAME_LENGTH`` characters keeping the extension; ``attachment`` if nothing is left."""
    text = str(name) if name is not None else ""
    text = re.sub(r"[/\\]", "_", text)
    text = "".join(
        "_" if (unicodedata.category(c)[0] in "CZ" and c != " ") or c in "\"'" else c
        for c in unicodedata.normalize("NFC", text)
    ).strip(" .")
    if len(text) > MAX_FILENAME_LENGTH:
        stem, dot, ext = text.rpartition(".")
        ext = ext[:20] if dot else ""
        stem = (stem if dot else text)[: MAX_FILENAME_LENGTH - len(ext) - 1]
        text = f"{stem}.{ext}" if ext else stem
    return text or "attachment"


def features(route: _Addressing) -> set[str]:
    """The ``FEATURES`` a route asks its adapter to carry."""
    wanted = {role for role in ("reply_to", "cc", "bcc") if getattr(route, role)}
    if route.envelope_sender is not None:
        wanted.add("envelope_sender")
    if route.attachments is not None:
        wanted.add("attachments")
    return wanted


def cannot_carry(provider: Any) -> frozenset[str]:
    """What ``provider`` declares it cannot carry (``cannot_carry``, a set of ``FEATURES``);
    a failover can carry only what both of its adapters can."""
    found = set(getattr(provider, "cannot_carry", frozenset()))
    for inner in (getattr(provider, "primary", None), getattr(provider, "secondary", None)):
        if inner is not None and inner is not provider:
            found |= cannot_carry(inner)
    return frozenset(found)


def refuse_uncarried(provider: Any, routes: Iterable[_Addressing]) -> None:
    """At start-up: a ``ConfigurationError`` naming the route, the field and the adapter when a
    route asks for what the adapter cannot carry (SMTP alone carries an envelope sender)."""
    missing = cannot_carry(provider)
    for route in routes:
        for feature in sorted(features(route) & missing):
            raise ConfigurationError(
                f"route {route.name} sets {feature}, which the {getattr(provider, 'name', '?')} "
                "adapter cannot carry: remove it from the route or use an adapter that can"
            )
