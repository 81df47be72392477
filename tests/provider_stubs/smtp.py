"""A real SMTP server on loopback (``aiosmtpd``) that records what it receives.

Optional STARTTLS or implicit TLS with a self-signed certificate made at test time by the
``openssl`` command line (the ``cryptography`` package is not a dependency), optional AUTH
(PLAIN/LOGIN) against one user, and SMTP-level faults chosen by the recipient address:

- ``+fail451xN`` (any 4xx code: ``+fail452xN``...): RCPT answers that code the first N times;
- ``+invalid``: RCPT answers ``550 5.1.1`` (unknown user);
- ``+datafail554``: the message is refused after DATA with ``554 5.6.0``.
"""

import email
import email.policy
import re
import shutil
import ssl
import subprocess
import threading
from collections import Counter
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword

_FAIL = re.compile(r"\+fail(?P<code>4\d\d)x(?P<times>\d+)@")


def self_signed_certificate(directory: Path) -> tuple[Path, Path] | None:
    """A certificate and key for 127.0.0.1 / localhost, or None without ``openssl``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = directory / "smtp-cert.pem", directory / "smtp-key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    message: EmailMessage
    raw: bytes
    tls: bool
    login: str | None


@dataclass
class _Handler:
    stub: "SmtpStub"

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: list[str]
    ) -> str:
        seen = self.stub._count(address)
        fail = _FAIL.search(address)
        if fail and seen <= int(fail["times"]):
            return f"{fail['code']} 4.7.1 <{address}>: Try again later"
        if "+invalid@" in address:
            return f"550 5.1.1 <{address}>: Recipient address rejected: User unknown"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        if any("+datafail554@" in rcpt for rcpt in envelope.rcpt_tos):
            return "554 5.6.0 Message content rejected"
        raw = bytes(envelope.original_content or envelope.content)
        # Parsed with local line endings, as a mail store would keep it.
        parsed = email.message_from_bytes(raw.replace(b"\r\n", b"\n"), policy=email.policy.default)
        auth = session.auth_data if isinstance(session.auth_data, LoginPassword) else None
        self.stub._record(
            Received(
                mail_from=envelope.mail_from,
                rcpt_tos=list(envelope.rcpt_tos),
                message=parsed,  # type: ignore[arg-type]
                raw=raw,
                # Read off the live transport: covers STARTTLS and implicit TLS alike.
                tls=server.transport.get_extra_info("ssl_object") is not None,
                login=auth.login.decode() if auth else None,
            )
        )
        return "250 2.0.0 Ok: queued"


class _Controller(Controller):
    """aiosmtpd's threaded controller on a free port, counting the connections it serves."""

    def __init__(self, stub: "SmtpStub", handler: Any, **kwargs: Any) -> None:
        super().__init__(handler, hostname="127.0.0.1", port=0, **kwargs)
        self._stub = stub

    def factory(self):  # type: ignore[no-untyped-def]
        self._stub._connected()
        return super().factory()

    def _trigger_server(self) -> None:
        # Bound to port 0: learn the real port before aiosmtpd connects to itself.
        assert self.server is not None
        self.port = self.server.sockets[0].getsockname()[1]
        super()._trigger_server()


@dataclass
class SmtpStub:
    """``with SmtpStub(...) as stub: ... stub.port``; ``stub.received`` is what was accepted."""

    certificate: tuple[Path, Path] | None = None
    #: "starttls" offers STARTTLS, "implicit" speaks TLS from the first byte.
    tls: str | None = None
    users: dict[str, str] | None = None
    auth_require_tls: bool = True
    idle_timeout_s: float = 300.0
    received: list[Received] = field(default_factory=list)
    connections: int = 0
    _seen: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _controller: _Controller | None = None

    def __enter__(self) -> "SmtpStub":
        kwargs: dict[str, Any] = {
            # aiosmtpd only counts STARTTLS as TLS; an implicit-TLS session is encrypted too.
            "auth_require_tls": self.auth_require_tls and self.tls != "implicit",
            "timeout": self.idle_timeout_s,
            "server_hostname": "stub.smtp.test",
        }
        if self.tls is not None:
            assert self.certificate is not None, "TLS needs a certificate"
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*self.certificate)
            kwargs["ssl_context" if self.tls == "implicit" else "tls_context"] = context
        if self.users is not None:
            kwargs["authenticator"] = self._authenticate
        self._controller = _Controller(self, _Handler(self), **kwargs)
        self._controller.start()
        with self._lock:
            self.connections = 0  # the controller's own start-up probe does not count
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._controller is not None:
            self._controller.stop()

    @property
    def port(self) -> int:
        assert self._controller is not None
        return self._controller.port

    def _authenticate(
        self, server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any
    ) -> AuthResult:
        ok = (
            isinstance(auth_data, LoginPassword)
            and self.users is not None
            and self.users.get(auth_data.login.decode()) == auth_data.password.decode()
        )
        # handled=False: aiosmtpd answers 535 itself on failure.
        return AuthResult(success=ok, handled=False, auth_data=auth_data if ok else None)

    def _count(self, address: str) -> int:
        with self._lock:
            self._seen[address] += 1
            return self._seen[address]

    def _record(self, received: Received) -> None:
        with self._lock:
            self.received.append(received)

    def _connected(self) -> None:
        with self._lock:
            self.connections += 1

    def to(self, address: str) -> list[Received]:
        return [r for r in self.received if address in r.rcpt_tos]
