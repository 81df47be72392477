"""What every provider adapter takes and returns."""

import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from email.utils import parseaddr
from typing import Protocol, runtime_checkable
from urllib.parse import quote

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, DeliveryError, PermanentError
from email_platform.mail.addressing import Attachment
from email_platform.mail.headers import all_safe, unsafe_header_reason
from email_platform.mail.provider_templates import ProviderTemplateCall


@dataclass(frozen=True)
class OutgoingEmail:
    """A rendered message, ready for one provider call."""

    message_id: int
    event_id: str
    idempotency_key: str
    sender: str
    to: str
    subject: str
    text: str
    html: str | None
    template: str
    lane: str
    headers: dict[str, str] = field(default_factory=dict)
    #: The publisher's request, for the provider's metadata (validated at publish: visible
    #: ASCII, no line breaks).
    trace_id: str | None = None
    correlation_id: str | None = None
    #: A provider-hosted template to render instead of subject/text/html (which are then
    #: empty): ``providers/templated.py`` builds each provider's form of it.
    provider_template: ProviderTemplateCall | None = None
    #: The route's other addresses (``mail/addressing.py``), each ``addr`` or ``Name <addr>``.
    reply_to: tuple[str, ...] = ()
    cc: tuple[str, ...] = ()
    bcc: tuple[str, ...] = ()
    #: The SMTP bounce address (``MAIL FROM``), when not the ``From`` address.
    envelope_sender: str | None = None
    attachments: tuple[Attachment, ...] = ()


def extra_addresses(email: OutgoingEmail) -> list[tuple[str, str]]:
    """``(role, address)`` of the Reply-To, Cc, Bcc and envelope sender addresses."""
    found = [
        (role, value)
        for role, values in (("reply_to", email.reply_to), ("cc", email.cc), ("bcc", email.bcc))
        for value in values
    ]
    if email.envelope_sender:
        found.append(("envelope_sender", email.envelope_sender))
    return found


def trace_metadata(email: OutgoingEmail) -> dict[str, str]:
    """``trace_id`` and ``correlation_id``, those that are set: the metadata adapters add next
    to ``event_id`` so the provider's records and webhooks name the publisher's request."""
    return {
        name: value
        for name, value in (("trace_id", email.trace_id), ("correlation_id", email.correlation_id))
        if value
    }


@dataclass(frozen=True)
class Accepted:
    provider_message_id: str
    status_code: int | None = None
    #: The provider that accepted it, when not the run's own (a failover's secondary).
    provider: str | None = None


def failover_provider(result: object) -> str | None:
    """The secondary provider that gave ``result`` (``Accepted.provider``, ``mark_provider``),
    or None: the run's own provider gave it."""
    return getattr(result, "provider", None)


def mark_provider(error: DeliveryError, provider: str) -> DeliveryError:
    """Name the secondary provider that gave ``error``, for ``failover_provider``."""
    error.provider = provider  # type: ignore[attr-defined]
    return error


@dataclass(frozen=True)
class History:
    """What is recorded of one message before this attempt (from its ``email_messages`` row)."""

    attempts: int
    #: The provider of its last recorded attempt (or the one it was prepared for).
    provider: str | None


class EmailProvider(Protocol):
    """Sends one message; raises ``TransientError`` or ``PermanentError`` when it cannot.

    Implementations are thread-safe: one instance (one keep-alive client) serves the bounded
    pool of concurrent sends in a run.
    """

    name: str

    def send(self, email: OutgoingEmail) -> Accepted: ...

    def close(self) -> None: ...


@runtime_checkable
class BatchingProvider(Protocol):
    """A provider that can also take several messages in one call (``batch_max`` > 1).

    ``send_many`` returns one result per message, in order, and never raises for a message's
    failure: a failure of the whole call (network, timeout, non-2xx) is every message's result,
    but for a request refused whole as invalid (400, 413, 422), which one message may have
    caused, and a body it could not build: those it raises as ``BatchNotSentError`` (nothing
    was sent), and the dispatcher sends the messages one a call. Any other raise may follow an
    acceptance: it is each message's result, never a reason to send again.
    Only adapters whose provider honours a per-message idempotency key inside a batch batch:
    a retried call must not send what the lost answer had already accepted.
    """

    batch_max: int

    def send_many(self, emails: Sequence[OutgoingEmail]) -> list[Accepted | DeliveryError]: ...


@runtime_checkable
class AsyncProvider(Protocol):
    """A provider that can also send from an event loop, where hundreds of calls in flight cost
    little (the HTTP adapters). ``async_ready`` False: use the blocking methods (a proxy or a
    test's mock transport is in the way). ``send_many_async`` is there when ``batch_max`` > 1.
    """

    async_ready: bool

    async def send_async(self, email: OutgoingEmail) -> Accepted: ...

    async def send_many_async(
        self, emails: Sequence[OutgoingEmail]
    ) -> list[Accepted | DeliveryError]: ...


@runtime_checkable
class HistoryAwareProvider(Protocol):
    """A provider that wants each message's history before it is sent (a failover: it may
    move a message to its secondary only if no earlier attempt may have been accepted)."""

    def expect(self, histories: dict[str, History]) -> None:
        """The histories of the messages about to be sent, by idempotency key."""
        ...

    def forget(self, keys: Iterable[str]) -> None:
        """Drop what ``expect`` was told of ``keys`` and no send took (the batch stopped)."""
        ...


def batch_max_option(settings: ProviderSettings, provider: str) -> int:
    """``EMAIL_PLATFORM_<PROVIDER>_BATCH_MAX``: messages one call carries (unset: 1, no batch)."""
    raw = settings.option("batch_max", "1") or "1"
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"EMAIL_PLATFORM_{provider}_BATCH_MAX must be a whole number, got {raw!r}"
        ) from None


def batch_limit(provider: str, batch_max: int, limit: int) -> int:
    """``batch_max`` if the provider takes that many a call (1 to ``limit``)."""
    if type(batch_max) is not int or not 1 <= batch_max <= limit:
        raise ConfigurationError(f"{provider} batch_max must be 1 to {limit}, got {batch_max!r}")
    return batch_max


class RateLimiter:
    """Token bucket shared by the concurrent sends of one run (0 = unlimited)."""

    def __init__(self, per_second: float) -> None:
        self.per_second = per_second
        self._lock = threading.Lock()
        self._next_slot = time.monotonic()

    def acquire(self, count: int = 1) -> None:
        """Wait for ``count`` messages' worth of tokens (a batch call takes one per message)."""
        delay = self.reserve(count)
        if delay > 0:
            time.sleep(delay)

    def reserve(self, count: int = 1) -> float:
        """Take ``count`` tokens; the seconds to wait before using them (an event loop awaits
        them instead of blocking in ``acquire``)."""
        if self.per_second <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            slot = max(self._next_slot, now)
            self._next_slot = slot + count / self.per_second
        return slot - now

    async def reserve_async(self, count: int = 1) -> float:
        """``reserve`` for an event loop (a shared limiter may need the database for it)."""
        return self.reserve(count)


#: Visible ASCII but ``%``: what a key keeps as it is in an ``Idempotency-Key`` header.
_KEY_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def idempotency_header(key: str) -> str:
    """``key`` as an ``Idempotency-Key`` header value: unchanged when it is ASCII; otherwise its
    UTF-8 percent-encoded (an HTTP header carries ASCII, and httpx refuses anything else). The
    same key gives the same value on every attempt, so the provider's deduplication holds."""
    if key.isascii():
        return key
    return quote(key, safe=_KEY_SAFE + " ")


def header_problem(email: OutgoingEmail) -> PermanentError | None:
    """Why ``email`` may not be sent as it is: a header value (or name) with a line break,
    raw or RFC 2047 encoded. Every adapter checks this before it builds a request, whatever
    was checked upstream, so no adapter's wire output can carry an injected header."""
    fields = [("sender", email.sender), ("to", email.to), ("subject", email.subject)]
    ambiguous: PermanentError | None = None
    # Adapters re-parse addresses (``parseaddr`` strips quotes and group names), so the parts
    # they write are checked as well as the whole.
    fields += extra_addresses(email)
    addresses = [("sender", email.sender), ("to", email.to), *extra_addresses(email)]
    for field_name, address in addresses:
        display_name, addr_spec = _address_parts(address)
        fields += [(f"{field_name} name", display_name), (f"{field_name} address", addr_spec)]
        bracketed = address.rpartition("<")[2].partition(">")[0] if "<" in address else None
        if ambiguous is None and bracketed is not None and bracketed.strip() != addr_spec:
            ambiguous = PermanentError(
                f"{field_name} {address!r} parses as {addr_spec!r}, not the address it shows",
                code="ambiguous_address",
            )
    fields += [("event_id", email.event_id), ("idempotency_key", email.idempotency_key)]
    fields += [
        (name, value)
        for name, value in (("trace_id", email.trace_id), ("correlation_id", email.correlation_id))
        if value is not None
    ]
    fields += [(f"attachment {a.filename!r}", a.filename) for a in email.attachments]
    fields += [(f"attachment {a.filename!r} type", a.content_type) for a in email.attachments]
    fields += [(f"header {name!r}", name) for name in email.headers]
    fields += [(f"header {name!r}", value) for name, value in email.headers.items()]
    # Nearly every message is clean: one scan over every value, then each only to name one.
    if all_safe(value for _, value in fields):
        return ambiguous
    for field_name, value in fields:
        reason = unsafe_header_reason(value)
        if reason is not None:
            return PermanentError(f"{field_name} {reason}", code="header_injection")
    return ambiguous


_ATOM = r"[A-Za-z0-9!#$%&'*+/^_`{|}~-]+"
_ADDR = rf"{_ATOM}(?:\.{_ATOM})*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*"
_SIMPLE_ADDRESS = re.compile(
    rf"( *(?P<name>[\w.'-]+(?: [\w.'-]+)*) *<(?P<bracketed>{_ADDR})>| *(?P<bare>{_ADDR})) *"
)


def _address_parts(address: str) -> tuple[str, str]:
    """``parseaddr(address)``, without its cost (~50 us) for the plain ``Name <a@b>`` and
    ``a@b`` forms, where nothing (quotes, comments, groups, encoded words) can make it differ."""
    match = _SIMPLE_ADDRESS.fullmatch(address)
    if match is None:
        return parseaddr(address)
    if match["bracketed"] is not None:
        return match["name"], match["bracketed"]
    return "", match["bare"]
