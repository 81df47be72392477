"""SMTP adapter: ``smtplib`` with STARTTLS (or implicit TLS) and AUTH, one message per call.

Options (``EMAIL_PLATFORM_SMTP_*``): ``BASE_URL`` (``smtp://host:port``, or ``smtps://`` for
implicit TLS) or ``HOST`` (default ``localhost``) and ``PORT`` (587, or 465 with ``SSL``),
``USERNAME`` / ``PASSWORD``, ``STARTTLS`` (``true``: upgrade when the server offers it, the
default; ``required``: refuse a server that does not; ``false``), ``SSL`` (implicit TLS),
``CA_FILE`` (a CA bundle to verify the server with; certificates are always verified),
``ALLOW_PLAINTEXT_AUTH`` (default false: credentials are never sent over an unencrypted
connection unless this says so) and ``LOCAL_HOSTNAME`` (the EHLO name).

The message (``smtp_message.py``): ``From``, ``To``, ``Subject``, ``Date``, ``Message-ID``,
``X-Email-Event-Id``, ``X-Email-Idempotency-Key``, the route's custom headers, and a
``multipart/alternative`` body with the text and HTML parts. The headers are written by the
adapter, not the standard library's folder: ASCII values folded at whitespace only, so
``List-Unsubscribe`` and the ``X-Email-*`` headers arrive byte for byte and never as encoded
words; non-ASCII text as encoded words that decode exactly; domains as IDNA A-labels. Any
header value (subject, display name, custom header) holding CR or LF is refused before a
connection is opened (``PermanentError``, code ``header_injection``). The envelope is given
explicitly, so no header can add a recipient. A route's ``Reply-To`` and ``Cc`` become headers,
its Cc and Bcc more ``RCPT TO``s (Bcc in no header), its envelope sender the ``MAIL FROM``, and
attachments make the body ``multipart/mixed`` (docs/addressing.md).

What the server offered decides the transaction: ``BODY=8BITMIME`` and 8-bit parts where it
offers 8BITMIME, quoted-printable where it does not; ``SMTPUTF8`` where an address has a
non-ASCII local part (or an ``X-Email-*`` value is non-ASCII) and the server offers it, a
permanent ``smtp_smtputf8_unavailable`` naming the cause, before ``MAIL FROM``, where it does
not.

Metadata and idempotency: SMTP has no metadata field and no idempotency guarantee. The event id
and idempotency key (and the publisher's trace and correlation ids, when set) travel as the
``X-Email-*`` headers, and the ``Message-ID`` is derived from
the idempotency key (``<{encoded key}@{sender domain}>``), so every retry of a message carries
the same Message-ID and a receiving system that deduplicates on it can drop a repeat; nothing
obliges it to. The key is encoded losslessly (characters other than ``A-Z a-z 0-9 _ -`` become
``=XX`` per UTF-8 byte), so two keys never share a Message-ID. ``Accepted.provider_message_id``
is that Message-ID.

Classification: reply codes 4xx are transient (``smtp_451``...), 5xx permanent
(``ProviderRejectedError``, ``smtp_550``...), per recipient for a refused RCPT. Connection errors,
timeouts and a dropped connection are transient. A failed login (535) is a permanent
``smtp_535`` rather than a ``ConfigurationError``: the send path turns any exception into a dead
letter, where a 535 keeps its code and reply, and the batch can be replayed once the
credentials are fixed; 454 (temporary authentication failure) stays transient.

Connections: ``smtplib.SMTP`` is not thread-safe, so each connection is used by one thread at a
time, drawn from a small pool of idle connections (at most ``max_connections``) and put back
after a transaction. Any failed transaction is aborted before the connection is pooled again
(``RSET`` after a refusal or an error before a command went out; the connection closed after a
socket error or a failure mid-``DATA``, whose state is unknown), so one failure never costs the
next message a ``503 nested MAIL command``. A connection is reused across messages and across
the short-lived thread pools of a run's attempts, and all are closed (``QUIT``) by
``close()``. A reused connection that the server has dropped while idle is detected at ``MAIL
FROM`` (before anything could have been accepted) and replaced once, transparently.
"""

import re
import smtplib
import ssl
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import format_datetime, parseaddr
from hashlib import sha256
from typing import Any, Self
from urllib.parse import urlsplit

from email_platform.common.classify import classify_exception
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import (
    ConfigurationError,
    DeliveryError,
    PermanentError,
    ProviderRejectedError,
    TransientError,
)
from email_platform.providers import templated
from email_platform.providers.base import Accepted, OutgoingEmail, RateLimiter, header_problem
from email_platform.providers.smtp_message import (
    LINE_SHOULD,
    SmtpMessage,
    address_list,
    phrase,
    wire_address,
)

#: Headers the adapter writes itself; a route may not override them.
RESERVED_HEADERS = frozenset(
    {
        "from",
        "to",
        "cc",
        "bcc",
        "sender",
        "subject",
        "date",
        "message-id",
        "mime-version",
        "content-type",
        "content-transfer-encoding",
        "return-path",
    }
)
_FIELD_NAME = re.compile(r"^[!-9;-~]+$")  # RFC 5322: printable ASCII except ":"
_ID_SAFE = re.compile(r"[A-Za-z0-9_-]")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class _StaleConnection(Exception):
    """A reused connection was found closed before this transaction started."""


class SmtpProvider:
    """Sends through an SMTP submission server. Thread-safe (see the module docstring)."""

    name = "smtp"

    def __init__(
        self,
        host: str = "localhost",
        port: int | None = None,
        *,
        username: str | None = None,
        password: str | None = None,
        starttls: str = "true",
        use_ssl: bool = False,
        ca_file: str | None = None,
        allow_plaintext_auth: bool = False,
        local_hostname: str | None = None,
        timeout_s: float = 10.0,
        rate_limit_per_s: float = 0.0,
        max_connections: int = 20,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if starttls not in ("true", "false", "required"):
            raise ConfigurationError(f"SMTP starttls must be true, false or required: {starttls!r}")
        self.host = host
        self.port = port if port is not None else (465 if use_ssl else 587)
        self.username = username
        self.password = password
        self.starttls = starttls
        self.use_ssl = use_ssl
        self.ca_file = ca_file
        self.allow_plaintext_auth = allow_plaintext_auth
        self.local_hostname = local_hostname
        self.timeout_s = timeout_s
        self.max_connections = max(1, max_connections)
        self.limiter = RateLimiter(rate_limit_per_s)
        self.clock = clock or (lambda: datetime.now(UTC))
        self._lock = threading.Lock()
        self._idle: list[smtplib.SMTP] = []
        self._closed = False

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        option = settings.option
        # EMAIL_PLATFORM_SMTP_BASE_URL (smtp://host:port, smtps:// for implicit TLS) gives the
        # defaults; the HOST, PORT and SSL options win over it.
        url = urlsplit(settings.base_url or "smtp://")
        if url.scheme not in ("smtp", "smtps"):
            raise ConfigurationError(
                f"SMTP base URL must be smtp://host:port or smtps://host:port: "
                f"{settings.base_url!r}"
            )
        use_ssl = _flag("ssl", option("ssl"), default=url.scheme == "smtps")
        starttls = (option("starttls") or "true").strip().lower()
        if starttls != "required":
            starttls = "true" if _flag("starttls", starttls, default=True) else "false"
        port = option("port")
        try:
            port_number = int(port) if port else url.port
        except ValueError:
            raise ConfigurationError(
                f"EMAIL_PLATFORM_SMTP_PORT is not a number: {port!r}"
            ) from None
        return cls(
            option("host") or url.hostname or "localhost",
            port_number,
            username=option("username") or None,
            password=option("password"),
            starttls=starttls,
            use_ssl=use_ssl,
            ca_file=option("ca_file") or None,
            allow_plaintext_auth=_flag(
                "allow_plaintext_auth", option("allow_plaintext_auth"), default=False
            ),
            local_hostname=option("local_hostname") or None,
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    # ---- the message ------------------------------------------------------------------------

    def build_message(self, email: OutgoingEmail) -> tuple[SmtpMessage, str]:
        """The message and its envelope sender; refuses header injection before anything."""
        templated.refuse(email, self.name)
        problem = header_problem(email)
        if problem is not None:
            raise problem
        display_name, sender_address = parseaddr(email.sender)
        if "@" not in sender_address:
            raise PermanentError(f"sender {email.sender!r} has no address", code="invalid_sender")
        from_address, sender_utf8 = wire_address(sender_address, "sender")
        envelope_from = from_address
        if email.envelope_sender:  # the bounce address, apart from From
            envelope_from, bounce_utf8 = wire_address(email.envelope_sender, "envelope_sender")
            sender_utf8 = sender_utf8 or bounce_utf8
        envelope_to, recipient_utf8 = wire_address(email.to, "recipient")
        message = SmtpMessage(envelope_from, envelope_to, email.text, email.html)
        message.needs_smtputf8(recipient_utf8)
        message.needs_smtputf8(sender_utf8)
        message.attachments = email.attachments
        if display_name:
            name = phrase(display_name, LINE_SHOULD - len("From: "))
            message.add_raw(
                "From", f"{display_name} <{from_address}>", f"From: {name} <{from_address}>\r\n"
            )
        else:
            message.add_raw("From", from_address, f"From: {from_address}\r\n")
        message.add_raw("To", envelope_to, f"To: {envelope_to}\r\n")
        _add_addresses(message, email)
        message.add("Subject", email.subject)
        message.add("Date", format_datetime(self.clock().astimezone(UTC)))
        domain = from_address.rsplit("@", 1)[1]
        message.add("Message-ID", message_id_for(email.idempotency_key, domain))
        message.add("X-Email-Event-Id", email.event_id)
        message.add("X-Email-Idempotency-Key", email.idempotency_key)
        # No metadata field in SMTP: the publisher's request travels as headers too.
        if email.trace_id:
            message.add("X-Email-Trace-Id", email.trace_id)
        if email.correlation_id:
            message.add("X-Email-Correlation-Id", email.correlation_id)
        for name, value in email.headers.items():
            if not _FIELD_NAME.fullmatch(name):
                raise PermanentError(f"invalid header name {name!r}", code="invalid_header")
            if name.lower() in RESERVED_HEADERS:
                raise PermanentError(
                    f"header {name!r} is set by the adapter", code="invalid_header"
                )
            if name in message:  # X-Email-Event-Id: the adapter's own value stands
                continue
            message.add(name, value)
        return message, envelope_from

    # ---- the call ---------------------------------------------------------------------------

    def send(self, email: OutgoingEmail) -> Accepted:
        try:
            message, _ = self.build_message(email)
        except UnicodeError as exc:  # text no UTF-8 can carry (a lone surrogate)
            raise PermanentError(
                f"the message cannot be serialized: {exc}", code="unencodable_text"
            ) from exc
        self.limiter.acquire()
        try:
            self._deliver(message)
        except DeliveryError:
            raise
        except Exception as exc:
            raise classify_smtp_error(exc) from exc
        return Accepted(str(message["Message-ID"]), None)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for connection in idle:
            _quit(connection)

    def _deliver(self, message: SmtpMessage) -> None:
        connection, reused = self._checkout()
        server = f"{self.host}:{self.port}"
        try:
            try:
                _transact(connection, message, server, reused=reused)
            except _StaleConnection:
                _quit(connection)
                connection = self._connect()
                _transact(connection, message, server, reused=False)
        finally:
            self._checkin(connection)

    def _checkout(self) -> tuple[smtplib.SMTP, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _checkin(self, connection: smtplib.SMTP) -> None:
        if connection.sock is not None:  # smtplib drops the socket when the server hangs up
            with self._lock:
                if not self._closed and len(self._idle) < self.max_connections:
                    self._idle.append(connection)
                    return
        _quit(connection)

    def _connect(self) -> smtplib.SMTP:
        connection: smtplib.SMTP
        if self.use_ssl:
            connection = smtplib.SMTP_SSL(
                self.host,
                self.port,
                local_hostname=self.local_hostname,
                timeout=self.timeout_s,
                context=self._tls_context(),
            )
        else:
            connection = smtplib.SMTP(
                self.host, self.port, local_hostname=self.local_hostname, timeout=self.timeout_s
            )
        try:
            connection.ehlo_or_helo_if_needed()
            encrypted = self.use_ssl
            if not self.use_ssl and self.starttls != "false":
                if connection.has_extn("starttls"):
                    connection.starttls(context=self._tls_context())
                    connection.ehlo()
                    encrypted = True
                elif self.starttls == "required":
                    raise PermanentError(
                        f"{self.host}:{self.port} does not offer STARTTLS and "
                        "EMAIL_PLATFORM_SMTP_STARTTLS=required",
                        code="smtp_starttls_unavailable",
                    )
            if self.username:
                if not encrypted and not self.allow_plaintext_auth:
                    raise PermanentError(
                        f"refusing to send SMTP credentials to {self.host}:{self.port} over an "
                        "unencrypted connection (set EMAIL_PLATFORM_SMTP_ALLOW_PLAINTEXT_AUTH "
                        "to allow it)",
                        code="smtp_plaintext_auth_refused",
                    )
                connection.login(self.username, self.password or "")
        except BaseException:
            _quit(connection)
            raise
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_file)


def _transact(connection: smtplib.SMTP, message: SmtpMessage, server: str, *, reused: bool) -> None:
    """One SMTP transaction: MAIL FROM, RCPT TO, DATA. However it ends, the connection is left
    with no transaction open (RSET after a refusal, closed when its state is unknown), so the
    next message on it is not refused as a nested MAIL."""
    connection.command_encoding = "ascii"  # smtplib keeps UTF-8 on after an SMTPUTF8 one
    options: list[str] = []
    eight_bit = message.has_8bit_body and connection.has_extn("8bitmime")
    if message.smtputf8_reason is not None:
        if not connection.has_extn("smtputf8"):
            raise PermanentError(
                f"{message.smtputf8_reason}: that needs SMTPUTF8 (RFC 6531), which {server} "
                "does not offer",
                code="smtp_smtputf8_unavailable",
            )
        options.append("SMTPUTF8")
        # UTF-8 headers are 8-bit data: declared so where the server takes it.
        eight_bit = connection.has_extn("8bitmime")
    if eight_bit:
        options.append("BODY=8BITMIME")
    try:
        payload = message.as_bytes(eight_bit=eight_bit)
    except (UnicodeError, ValueError) as exc:  # a lone surrogate in a body, say
        raise PermanentError(
            f"the message cannot be serialized: {exc}", code="unencodable_text"
        ) from exc
    if connection.has_extn("size"):
        options.insert(0, f"SIZE={len(payload)}")
    try:
        code, reply = connection.mail(message.envelope_from, options)
    except (smtplib.SMTPServerDisconnected, OSError) as exc:
        if reused:
            raise _StaleConnection from exc
        raise
    if code == 421 and reused:  # the server closed the idle connection, politely
        raise _StaleConnection
    if code != 250:
        _reset(connection, code)
        raise smtplib.SMTPSenderRefused(code, reply, message.envelope_from)
    # A transaction is open from here: every way out of it below aborts it.
    in_data = False
    try:
        for recipient in (message.envelope_to, *message.extra_recipients):  # Bcc: RCPT only
            code, reply = connection.rcpt(recipient)
            if code not in (250, 251):
                raise smtplib.SMTPRecipientsRefused({recipient: (code, reply)})
        in_data = True
        code, reply = connection.data(payload)  # SMTPDataError when DATA gets no 354
        if code != 250:
            raise smtplib.SMTPDataError(code, reply)
    except smtplib.SMTPRecipientsRefused as exc:
        _reset(connection, next(iter(exc.recipients.values()))[0])
        raise
    except smtplib.SMTPResponseException as exc:  # a reply: the server is between commands
        _reset(connection, exc.smtp_code)
        raise
    except BaseException as exc:
        lost = isinstance(exc, smtplib.SMTPServerDisconnected) or (
            isinstance(exc, OSError) and not isinstance(exc, smtplib.SMTPException)
        )
        # Mid-DATA no command would be read as one, and after a socket error or timeout a late
        # reply could be read as RSET's: the connection is dropped. Otherwise nothing left
        # unanswered is on the wire, and RSET aborts the transaction.
        if in_data or lost or not isinstance(exc, Exception):
            connection.close()
        else:
            _reset(connection, 0)
        raise


def _add_addresses(message: SmtpMessage, email: OutgoingEmail) -> None:
    """``Cc`` and ``Reply-To`` headers; Cc and Bcc as more recipients of the envelope (Bcc in
    no header)."""
    for name, role, values in (("Cc", "cc", email.cc), ("Reply-To", "reply_to", email.reply_to)):
        entries = []
        for value in values:
            display_name, address = parseaddr(value)
            wired, utf8 = wire_address(address, role)
            message.needs_smtputf8(utf8)
            entries.append((display_name, wired))
            if role == "cc":
                message.extra_recipients.append(wired)
        if entries:
            message.add_raw(name, *address_list(name, entries))
    for value in email.bcc:
        wired, utf8 = wire_address(parseaddr(value)[1], "bcc")
        message.needs_smtputf8(utf8)
        message.extra_recipients.append(wired)


def _reset(connection: smtplib.SMTP, code: int) -> None:
    """Abort the transaction so the connection can carry the next message."""
    if code == 421:  # the server is closing the channel
        connection.close()
        return
    try:
        connection.rset()
    except (smtplib.SMTPException, OSError):
        connection.close()


def _quit(connection: smtplib.SMTP) -> None:
    try:
        if connection.sock is not None:
            connection.quit()
    except (smtplib.SMTPException, OSError):
        pass
    finally:
        connection.close()


def classify_smtp_error(exc: BaseException) -> DeliveryError:
    """The error an ``smtplib`` or socket exception stands for."""
    if isinstance(exc, DeliveryError):
        return exc
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        refused = list(exc.recipients.items())
        # One transient refusal is enough to be worth a retry.
        address, (code, reply) = next(((a, r) for a, r in refused if 400 <= r[0] < 500), refused[0])
        return _by_reply_code(code, f"RCPT TO <{address}> refused: {code} {_text(reply)}")
    if isinstance(exc, smtplib.SMTPResponseException):
        stage = {
            smtplib.SMTPSenderRefused: "MAIL FROM refused",
            smtplib.SMTPDataError: "DATA refused",
            smtplib.SMTPConnectError: "connection refused",
            smtplib.SMTPHeloError: "HELO refused",
            smtplib.SMTPAuthenticationError: "authentication failed",
        }.get(type(exc), "SMTP error")
        return _by_reply_code(exc.smtp_code, f"{stage}: {exc.smtp_code} {_text(exc.smtp_error)}")
    if isinstance(exc, smtplib.SMTPServerDisconnected):
        if isinstance(exc.__context__, TimeoutError):
            return TransientError(f"SMTP timeout: {exc}", code="timeout")
        return TransientError(f"SMTP server disconnected: {exc}", code="smtp_disconnected")
    if isinstance(exc, smtplib.SMTPNotSupportedError):
        return PermanentError(f"SMTP server lacks a feature: {exc}", code="smtp_unsupported")
    if isinstance(exc, smtplib.SMTPException):  # an OSError too: decided before those
        return PermanentError(f"SMTP error: {exc}", code="smtp_error")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return PermanentError(
            f"SMTP server certificate not trusted: {exc}", code="smtp_tls_verify_failed"
        )
    if isinstance(exc, TimeoutError):
        return TransientError(f"SMTP timeout: {exc}", code="timeout")
    if isinstance(exc, OSError):
        return TransientError(f"SMTP network error: {type(exc).__name__}: {exc}", code="network")
    return classify_exception(exc)


def _by_reply_code(code: int, message: str) -> DeliveryError:
    if 500 <= code < 600:
        return ProviderRejectedError(message, code=f"smtp_{code}")
    # 4xx, and the odd -1 smtplib reports for an unreadable reply: worth another try.
    return TransientError(message, code=f"smtp_{code}")


def _text(reply: bytes | str) -> str:
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)


def message_id_for(idempotency_key: str, domain: str) -> str:
    """``<{key}@{domain}>`` with the key encoded losslessly into Message-ID characters."""
    left = "".join(
        char if _ID_SAFE.fullmatch(char) else "".join(f"={b:02X}" for b in char.encode())
        for char in idempotency_key
    )
    if len(left) > 200:  # keep the header well inside the 998-character line limit
        left = f"{left[:136]}.{sha256(idempotency_key.encode()).hexdigest()}"
    return f"<{left or '='}@{domain.lower()}>"


def _flag(name: str, value: Any, *, default: bool) -> bool:
    if value is None:
        return default
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigurationError(f"EMAIL_PLATFORM_SMTP_{name.upper()} is not a boolean: {value!r}")
