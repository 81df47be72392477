"""One-click unsubscribe (RFC 8058): signed, expiring links and bulk mail's headers.

A token is ``<payload>.<mac>``, both unpadded urlsafe base64. The payload is the JSON array
``[1, expires_at, route, address]`` (expiry in Unix seconds); the MAC is HMAC-SHA256 under the
configured secret over a context string and the payload bytes. The receiver needs no table of
issued links: whatever verifies was made by us, for that address and route, until it expires.
The address is readable in the token (it is the reader's own address), so the receiver never
logs a token or a path.

Only mail of a bulk-lane route carries ``List-Unsubscribe`` and ``List-Unsubscribe-Post``: a
route that bypasses unsubscribes (security mail) must not offer one it would ignore.
"""

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from email.utils import parseaddr

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.mail.routes import Route

VERSION = 1
#: Longer than any token we issue (a 320-character address, escaped); anything longer is junk.
MAX_TOKEN_CHARS = 2048
#: SES takes header values of at most 995 printable ASCII characters; the mailto is dropped
#: first, and mail whose https link alone is longer gets no List-Unsubscribe at all.
MAX_HEADER_CHARS = 995
MIN_SECRET_CHARS = 16
POST_VALUE = "List-Unsubscribe=One-Click"
PATH_PREFIX = "/unsubscribe/"
_CONTEXT = b"email_platform.unsubscribe.v1\x00"
_B64 = re.compile(r"[A-Za-z0-9_-]+")
# No quotes, spaces, commas or angle brackets (they would end the <...> of the header), no
# query or fragment (the token is appended to the path).
_BASE_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%!$&'()*+;=:@/-]*)?")
_MAILTO = re.compile(r"[A-Za-z0-9._+-]{1,64}@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+")
_MAX_BASE_URL_CHARS = 200


class TokenError(ValueError):
    """An unsubscribe token that must change nothing."""


class InvalidToken(TokenError):
    """Malformed, truncated, tampered with or signed under another secret."""


class ExpiredToken(TokenError):
    """Authentic, but past its expiry."""


@dataclass(frozen=True)
class Claim:
    """What a verified token says: unsubscribe ``address`` (it came in mail of ``route``)."""

    address: str
    route: str
    expires_at: int


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(field: str, text: str) -> bytes:
    """Strict: only the urlsafe alphabet, and only the one canonical spelling of the bytes
    (otherwise a flipped padding bit would be a second, equally valid token)."""
    if not _B64.fullmatch(text):
        raise InvalidToken(f"token {field} is not urlsafe base64")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise InvalidToken(f"token {field} is not urlsafe base64") from None
    if _b64encode(data) != text:
        raise InvalidToken(f"token {field} is not canonical base64")
    return data


def _mac(secret: str, payload: bytes) -> bytes:
    return hmac.new(secret.encode("utf-8"), _CONTEXT + payload, hashlib.sha256).digest()


def sign(secret: str, address: str, route: str, expires_at: datetime | int) -> str:
    """A token for ``address`` and ``route``, valid until ``expires_at``."""
    expiry = expires_at if isinstance(expires_at, int) else int(expires_at.timestamp())
    payload = json.dumps([VERSION, expiry, route, address], separators=(",", ":")).encode()
    return f"{_b64encode(payload)}.{_b64encode(_mac(secret, payload))}"


def verify(secrets: Sequence[str], token: object, now: datetime) -> Claim:
    """The claim of ``token`` if one of ``secrets`` signed it; raises ``InvalidToken`` or
    (authentic but late) ``ExpiredToken``. The MAC is checked before anything is parsed."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        raise InvalidToken("token is empty or too long")
    encoded, dot, encoded_mac = token.partition(".")
    if not dot:
        raise InvalidToken("token has no signature")
    payload = _b64decode("payload", encoded)
    mac = _b64decode("signature", encoded_mac)
    if not any(hmac.compare_digest(_mac(secret, payload), mac) for secret in secrets):
        raise InvalidToken("token signature does not match")
    try:
        version, expiry, route, address = json.loads(payload)
    except (ValueError, TypeError):
        raise InvalidToken("token payload is not [version, expiry, route, address]") from None
    if (
        version != VERSION
        or type(expiry) is not int
        or not isinstance(route, str)
        or not isinstance(address, str)
        or "@" not in address
    ):
        raise InvalidToken("token payload is not [version, expiry, route, address]")
    if expiry <= now.timestamp():
        raise ExpiredToken("token has expired")
    return Claim(address=address, route=route, expires_at=expiry)


@dataclass(frozen=True)
class Keys:
    """The secrets the receiver verifies with: the current one first, then the old one."""

    secrets: tuple[str, ...]

    def verify(self, token: object, now: datetime) -> Claim:
        return verify(self.secrets, token, now)


def receiver_keys(settings: config.UnsubscribeSettings) -> Keys | None:
    """The receiver's keys, or ``None`` (every ``/unsubscribe`` is a 404) with no secret."""
    secrets = tuple(s for s in (settings.secret, settings.old_secret) if s)
    if not settings.secret:
        return None
    short = [s for s in secrets if len(s) < MIN_SECRET_CHARS]
    if short:
        raise ConfigurationError(
            f"{config.PREFIX}UNSUBSCRIBE_SECRET (and _OLD_SECRET) must be at least "
            f"{MIN_SECRET_CHARS} characters"
        )
    return Keys(secrets)


class Links:
    """Makes bulk mail's ``List-Unsubscribe`` headers; empty while unconfigured.

    ``problem`` holds a configuration error found when the settings were read: raised the
    first time a bulk route asks for headers, so a bad setting stops bulk mail, never other.
    """

    def __init__(
        self,
        *,
        secret: str | None = None,
        base_url: str | None = None,
        mailto: str | None = None,
        ttl_s: float = config.UNSUBSCRIBE_TTL_DAYS * 86400,
        problem: ConfigurationError | None = None,
    ) -> None:
        self.secret = secret
        self.base_url = base_url.rstrip("/") if base_url else None
        self.mailto = mailto or None
        self.ttl_s = ttl_s
        self.problem = problem

    @property
    def enabled(self) -> bool:
        return bool(self.secret and self.base_url)

    def headers_for(self, route: Route, address: str, now: datetime) -> dict[str, str]:
        if not route.honours_unsubscribe:
            return {}
        if self.problem is not None:
            raise self.problem
        if not self.enabled:
            return {}
        token = sign(self.secret or "", address, route.name, int(now.timestamp() + self.ttl_s))
        url = f"<{self.base_url}{PATH_PREFIX}{token}>"
        value = url
        if self.mailto:
            value = f"{url}, <mailto:{self.mailto}?subject=unsubscribe%20{token}>"
        if len(value) > MAX_HEADER_CHARS:
            value = url
        if len(value) > MAX_HEADER_CHARS:
            return {}
        return {"List-Unsubscribe": value, "List-Unsubscribe-Post": POST_VALUE}


def links_from_settings(settings: config.UnsubscribeSettings, sender: str) -> Links:
    """``Links`` for ``settings``; raises ``ConfigurationError`` for a value it cannot use.

    The mailto address is ``settings.mailto``, else ``unsubscribe@`` the sender's domain.
    """
    if not (settings.secret and settings.base_url):
        return Links()
    receiver_keys(settings)  # the same length check the receiver makes
    base_url = settings.base_url
    if len(base_url) > _MAX_BASE_URL_CHARS or not _BASE_URL.fullmatch(base_url):
        raise ConfigurationError(
            f"{config.PREFIX}UNSUBSCRIBE_BASE_URL must be an http(s) URL of at most "
            f"{_MAX_BASE_URL_CHARS} ASCII characters without query, fragment, spaces, quotes, "
            f"commas or angle brackets, got {base_url[:100]!r}"
        )
    mailto = settings.mailto
    if mailto is None:
        domain = parseaddr(sender)[1].rpartition("@")[2]
        mailto = f"unsubscribe@{domain}" if _MAILTO.fullmatch(f"unsubscribe@{domain}") else ""
    elif mailto and not _MAILTO.fullmatch(mailto):
        raise ConfigurationError(
            f"{config.PREFIX}UNSUBSCRIBE_MAILTO must be a plain ASCII address or 'none', "
            f"got {mailto[:100]!r}"
        )
    return Links(secret=settings.secret, base_url=base_url, mailto=mailto, ttl_s=settings.ttl_s)


def links_from_config(sender: str, *, strict: bool) -> Links:
    """``Links`` from the environment. ``strict`` (a bulk-lane run) raises a bad setting now,
    before anything is claimed; otherwise it is kept for the first bulk route that asks."""
    try:
        return links_from_settings(config.unsubscribe_settings(), sender)
    except (ConfigurationError, ValueError) as exc:
        problem = exc if isinstance(exc, ConfigurationError) else ConfigurationError(str(exc))
        if strict:
            raise problem from None
        return Links(problem=problem)
