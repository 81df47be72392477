"""Amazon SES API v2 adapter: ``SendEmail`` as a simple message, signed with SigV4.

The wire format is the one the SES v2 API reference documents for ``SendEmail``::

    POST /v2/email/outbound-emails                      (https://email.{region}.amazonaws.com)
    Content-Type: application/json
    X-Amz-Date: 20261129T142218Z
    Authorization: AWS4-HMAC-SHA256 Credential=AKID/20261129/{region}/ses/aws4_request, ...

    {"FromEmailAddress": ..., "Destination": {"ToAddresses": [...]},
     "Content": {"Simple": {"Subject": {...}, "Body": {"Text": {...}, "Html": {...}},
                            "Headers": [{"Name": ..., "Value": ...}]}},
     "EmailTags": [{"Name": ..., "Value": ...}], "ConfigurationSetName": ...}

and answers ``200 {"MessageId": ...}``. Errors carry their type in the ``x-amzn-ErrorType``
header (``TooManyRequestsException:http://...``) or in the body (``code`` / ``__type``), and a
``message``; they are classified by that type first and the HTTP status second, because SES
answers some throttling with 400 (``LimitExceededException`` and the common
``ThrottlingException``), which a status-only rule would dead-letter.

Metadata: ``event_id``, ``idempotency_key``, ``template``, ``lane`` (and the publisher's
``trace_id`` and ``correlation_id``, when set) go out as message tags
(``EmailTags``), which SES copies into every event it publishes through a configuration set.
SES allows only ASCII letters, digits, ``_`` and ``-`` in a tag value (at most 256 characters),
so every other character becomes ``_`` (``01J...:welcome`` -> ``01J..._welcome``); see
:func:`tag_value`. That mapping is not one-to-one, so a webhook normalizer joins on the
``event_id`` tag (a ULID, sent unchanged) and the SES ``MessageId``, and uses the sanitized key
only as a cross-check. The exact key also travels as the ``X-Email-Idempotency-Key`` header.

Addresses: SES's model (the ``Destination`` shape) says SES does not support SMTPUTF8 (RFC
6531), so a local part must be 7-bit ASCII, and a non-ASCII domain must be sent in Punycode
(RFC 3492). Domains are therefore IDNA-encoded here (``jane@bücher.example.com`` goes out as
``jane@xn--bcher-kva.example.com``), and an address with a non-ASCII local part is refused,
permanently, with the code ``smtputf8_unsupported`` (no retry could send it through SES).

Idempotency: SES ``SendEmail`` takes no idempotency token or header (its request has no such
member). The accepted-then-lost window of docs/design.md invariant 3 therefore stays open with SES:
a send whose answer is lost (timeout after SES accepted) is retried and may be delivered twice.

Credentials come from ``EMAIL_PLATFORM_SES_ACCESS_KEY_ID`` / ``_SECRET_ACCESS_KEY`` /
``_SESSION_TOKEN`` when set, else from botocore's default chain (``AWS_*`` variables, shared
config, container or instance role), refreshed per request when the chain rotates them.
"""

import json
import re
from collections.abc import Callable, Generator
from datetime import UTC, datetime
from email.utils import formataddr, parseaddr
from typing import Any, Self

import httpx
import idna
from botocore.auth import SIGV4_TIMESTAMP, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials, ReadOnlyCredentials
from botocore.session import Session as BotocoreSession

from email_platform.common.classify import THROTTLE_CODES, classify_response, parse_retry_after
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import (
    ConfigurationError,
    DeliveryError,
    PermanentError,
    ProviderRejectedError,
    TransientError,
)
from email_platform.common.tags import tag_value
from email_platform.providers import ses_raw, templated
from email_platform.providers.base import Accepted, OutgoingEmail, header_problem, trace_metadata
from email_platform.providers.http import HttpProvider, ProviderRequest

SEND_EMAIL_PATH = "/v2/email/outbound-emails"
SIGNING_SERVICE = "ses"  # the SES v2 API is signed as "ses", though its endpoint is "email."
DEFAULT_REGION = "us-east-1"

#: Throttling and quota answers: transient whatever their status (some come as 400).
THROTTLING_CODES = THROTTLE_CODES
#: Server-side failures that some AWS front ends report with a non-5xx status.
SERVER_CODES = frozenset(
    {
        "InternalFailure",
        "InternalServiceErrorException",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
    }
)
#: SendEmail's documented permanent errors (400/404): dead-lettered with their code whatever
#: the status. Codes in none of these sets are classified by status (429/5xx transient).
PERMANENT_CODES = frozenset(
    {
        "MessageRejected",
        "MailFromDomainNotVerifiedException",
        "SendingPausedException",
        "AccountSuspendedException",
        "NotFoundException",
        "BadRequestException",
    }
)

_HEADER_NAME = re.compile(r"^[!-9;-~]{1,126}$")  # printable ASCII but ":" (SES MessageHeaderName)
_HEADER_VALUE = re.compile(r"^[ -~]{1,995}$")  # printable ASCII (SES MessageHeaderValue)
_XML_CODE = re.compile(
    r"<Code>(?P<code>[A-Za-z0-9.]{1,100})</Code>(?:<Message>(?P<message>[^<]*))?"
)
MAX_HEADERS = 15  # SES MessageHeaderList: at most 15 headers a message


def error_code_of(response: httpx.Response) -> tuple[str | None, str]:
    """The AWS error code and message of an answer, read the way botocore's rest-json
    parser reads them: ``x-amzn-ErrorType`` first, then the body's ``code``/``Code``, then
    ``__type``; ``Foo:http://...`` and ``aws.prefix#Foo`` both mean ``Foo``."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    raw = (
        response.headers.get("x-amzn-ErrorType")
        or body.get("code")
        or body.get("Code")
        or body.get("__type")
    )
    code = str(raw).split(":", 1)[0].rsplit("#", 1)[-1].strip() if raw else None
    message = body.get("message") or body.get("Message")
    if not raw and not body:
        # An XML ``<ErrorResponse>`` (the query protocol's form, which moto's IAM checks
        # answer with): its ``<Code>`` still names the cause in the dead letter.
        xml = _XML_CODE.search(response.text)
        if xml:
            code, message = xml["code"], xml["message"] or response.text[:300]
    if message is None:
        message = response.text[:300] if not body else json.dumps(body)[:300]
    return code or None, str(message)


class _ClockedSigV4Auth(SigV4Auth):
    """botocore's SigV4 signer with the signing time taken from ``clock``.

    ``SigV4Auth.add_auth`` reads the time from a module global; this does the same steps
    through the signer's public methods, so tests can freeze the time without patching.
    """

    def __init__(
        self,
        credentials: ReadOnlyCredentials | Credentials,
        service_name: str,
        region_name: str,
        clock: Callable[[], datetime],
    ) -> None:
        super().__init__(credentials, service_name, region_name)
        self._clock = clock

    def add_auth(self, request: AWSRequest) -> None:
        timestamp = self._clock().astimezone(UTC).strftime(SIGV4_TIMESTAMP)
        request.context["timestamp"] = timestamp
        for name in ("Authorization", "X-Amz-Date", "X-Amz-Security-Token"):
            if name in request.headers:
                del request.headers[name]
        request.headers["X-Amz-Date"] = timestamp
        if self.credentials.token:
            request.headers["X-Amz-Security-Token"] = self.credentials.token
        canonical = self.canonical_request(request)
        signature = self.signature(self.string_to_sign(request, canonical), request)
        signed = self.signed_headers(self.headers_to_sign(request))
        request.headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.scope(request)}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )


class HttpxSigV4Auth(httpx.Auth):
    """Signs each httpx request, as finally sent (URL, ``Host``, body), with SigV4.

    Signed headers: ``content-type``, ``host``, ``x-amz-date`` and, with temporary
    credentials, ``x-amz-security-token`` — nothing a proxy or the HTTP stack may rewrite.
    Each attempt is signed anew, so a retry never carries a stale ``X-Amz-Date``.
    """

    requires_request_body = True

    def __init__(
        self,
        credentials: Credentials,
        region: str,
        *,
        service: str = SIGNING_SERVICE,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.credentials = credentials
        self.region = region
        self.service = service
        self.clock = clock or (lambda: datetime.now(UTC))

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self.sign(request)
        yield request

    def sign(self, request: httpx.Request) -> None:
        headers = {"Host": request.headers["Host"]}
        if "Content-Type" in request.headers:
            headers["Content-Type"] = request.headers["Content-Type"]
        aws = AWSRequest(
            method=request.method, url=str(request.url), data=request.content, headers=headers
        )
        # Frozen per request: refreshable credentials may rotate between two attribute reads.
        frozen = self.credentials.get_frozen_credentials()
        _ClockedSigV4Auth(frozen, self.service, self.region, self.clock).add_auth(aws)
        for name in ("X-Amz-Date", "X-Amz-Security-Token", "Authorization"):
            if name in aws.headers:
                request.headers[name] = aws.headers[name]


class SesProvider(HttpProvider):
    """Amazon SES v2 ``SendEmail`` over one keep-alive client, signed per request."""

    name = "ses"
    #: SES writes its own MAIL FROM (its custom MAIL FROM domain setting).
    cannot_carry = frozenset({"envelope_sender"})

    def __init__(
        self,
        base_url: str | None = None,
        *,
        region: str = DEFAULT_REGION,
        credentials: Credentials,
        configuration_set: str | None = None,
        clock: Callable[[], datetime] | None = None,
        **kwargs: Any,
    ) -> None:
        self.region = region
        self.configuration_set = configuration_set
        super().__init__(
            base_url or default_base_url(region),
            auth=HttpxSigV4Auth(credentials, region, clock=clock),
            **kwargs,
        )

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        region = settings.option("region") or DEFAULT_REGION
        return cls(
            settings.base_url or default_base_url(region),
            region=region,
            credentials=_credentials(settings),
            configuration_set=settings.option("configuration_set") or None,
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    # ---- the request ------------------------------------------------------------------------

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        return ProviderRequest(
            "POST",
            SEND_EMAIL_PATH,
            headers={"Content-Type": "application/json"},
            # Serialized here, not by httpx, so the signed bytes are exactly the bytes built.
            content=json.dumps(self.body(email), separators=(",", ":")).encode("ascii"),
        )

    def body(self, email: OutgoingEmail) -> dict[str, Any]:
        """The ``SendEmail`` request body for one message."""
        _refuse_line_breaks(email)
        content_body: dict[str, Any] = {"Text": {"Data": email.text, "Charset": "UTF-8"}}
        if email.html is not None:
            content_body["Html"] = {"Data": email.html, "Charset": "UTF-8"}
        request: dict[str, Any] = {
            "FromEmailAddress": from_address(email.sender),
            "Destination": ses_raw.destination(email, ses_address),
            "Content": {
                "Simple": {
                    "Subject": {"Data": email.subject, "Charset": "UTF-8"},
                    "Body": content_body,
                    "Headers": _headers(email),
                }
            }
            if not email.attachments
            else ses_raw.raw_content(email, _headers(email), ascii_address),
            # Raw content carries its Reply-To header itself.
            **({} if email.attachments else ses_raw.reply_to(email, ses_address)),
            "EmailTags": [
                {"Name": "event_id", "Value": tag_value(email.event_id)},
                {"Name": "idempotency_key", "Value": tag_value(email.idempotency_key)},
                {"Name": "template", "Value": tag_value(email.template)},
                {"Name": "lane", "Value": tag_value(email.lane)},
                # Tags allow only [A-Za-z0-9_-]: other characters of an opaque id become "_".
                *({"Name": k, "Value": tag_value(v)} for k, v in trace_metadata(email).items()),
            ],
        }
        if self.configuration_set:
            request["ConfigurationSetName"] = self.configuration_set
        templated.ses_body(request, email)
        return request

    # ---- the answers ------------------------------------------------------------------------

    def accepted(self, response: httpx.Response) -> Accepted:
        return Accepted(str(response.json()["MessageId"]), response.status_code)

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        return error_code_of(response)

    def classify(self, response: httpx.Response) -> DeliveryError:
        code, message = self.error_of(response)
        if code in THROTTLING_CODES or code in SERVER_CODES:
            return TransientError(
                f"HTTP {response.status_code} {code}: {message}",
                status_code=response.status_code,
                code=code,
                retry_after_s=parse_retry_after(
                    response.headers.get("retry-after"), cap_s=self.retry_after_cap_s
                ),
            )
        if code in PERMANENT_CODES:
            return ProviderRejectedError(
                f"HTTP {response.status_code} {code}: {message}",
                status_code=response.status_code,
                code=code,
            )
        return classify_response(
            response.status_code,
            response.headers,
            code=code,
            message=f"{code}: {message}" if code else message,
            retry_after_cap_s=self.retry_after_cap_s,
        )


def default_base_url(region: str) -> str:
    """The public SES v2 endpoint of ``region``."""
    return f"https://email.{region}.amazonaws.com"


def from_address(sender: str) -> str:
    """``sender`` as SES wants ``FromEmailAddress``: a non-ASCII display name MIME-encoded, an
    internationalized domain in Punycode."""
    return ses_address(sender, "sender")


def ses_address(value: str, field: str) -> str:
    """``value`` (``addr`` or ``Name <addr>``) in the 7-bit form SES's model asks for: the
    domain IDNA-encoded, a non-ASCII display name RFC 2047-encoded. A non-ASCII local part
    needs SMTPUTF8, which SES does not support: a permanent error naming that cause."""
    if value.isascii():
        return value
    name, address = parseaddr(value)
    address = ascii_address(address, field)
    if not name:
        return address
    # formataddr refuses a non-ASCII address, so it gets the encoded one.
    return formataddr((name, address), charset="utf-8")


def ascii_address(address: str, field: str) -> str:
    """``local@domain`` with the domain in Punycode (IDNA 2008 with UTS 46 mapping, as
    ``email-validator`` checks it at publish)."""
    if address.isascii():
        return address
    local, at, domain = address.rpartition("@")
    if not at or not local.isascii():
        raise PermanentError(
            f"the {field} address has a non-ASCII local part, which needs SMTPUTF8 "
            "(RFC 6531); SES does not support it",
            code="smtputf8_unsupported",
        )
    try:
        ascii_domain = idna.encode(domain, uts46=True).decode("ascii")
    except idna.IDNAError as exc:
        raise PermanentError(
            f"the {field} address's domain is not a valid internationalized domain: {exc}",
            code="invalid_address",
        ) from None
    return f"{local}@{ascii_domain}"


def _credentials(settings: ProviderSettings) -> Credentials:
    access_key = settings.option("access_key_id")
    secret_key = settings.option("secret_access_key")
    if access_key or secret_key:
        if not (access_key and secret_key):
            raise ConfigurationError(
                "EMAIL_PLATFORM_SES_ACCESS_KEY_ID and EMAIL_PLATFORM_SES_SECRET_ACCESS_KEY "
                "must be set together"
            )
        return Credentials(access_key, secret_key, settings.option("session_token") or None)
    found = BotocoreSession().get_credentials()
    if found is None:
        raise ConfigurationError(
            "no AWS credentials for SES: set EMAIL_PLATFORM_SES_ACCESS_KEY_ID and "
            "EMAIL_PLATFORM_SES_SECRET_ACCESS_KEY, or provide them the AWS way (role, profile)"
        )
    return found


def _refuse_line_breaks(email: OutgoingEmail) -> None:
    problem = header_problem(email)
    if problem is not None:
        raise problem


def _headers(email: OutgoingEmail) -> list[dict[str, str]]:
    """Custom headers, plus the event id and idempotency key, as SES ``MessageHeader``s."""
    wanted = {
        "X-Email-Event-Id": email.event_id,
        "X-Email-Idempotency-Key": email.idempotency_key,
    }
    for name, value in email.headers.items():
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
            raise PermanentError(f"header {name!r} contains CR or LF", code="header_injection")
        if not _HEADER_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(value):
            raise PermanentError(
                f"header {name!r} is not printable ASCII as SES requires", code="invalid_header"
            )
        if name.lower() not in {key.lower() for key in wanted}:
            wanted[name] = value
    if len(wanted) > MAX_HEADERS:
        raise PermanentError(
            f"{len(wanted)} headers; SES takes at most {MAX_HEADERS} a message",
            code="too_many_headers",
        )
    return [
        {"Name": name, "Value": value}
        for name, value in wanted.items()
        # A publisher's idempotency key may hold characters SES refuses in a header; the
        # (sanitized) tag still carries it then.
        if _HEADER_VALUE.fullmatch(value)
    ]
