"""A local Amazon SES v2 ``SendEmail`` endpoint that checks what the real one checks.

It recomputes every request's SigV4 signature with botocore from the headers the client says
it signed, the body as received and the stub's secret key, and refuses the request the way AWS
does when it does not match, is stale or is signed for another region or service. It checks
the ``SendEmail`` body shape and SES's rules for message tags and headers, records each accepted
message, and answers with SES's documented errors when the recipient asks for one:

- ``+throttlexN``: the first N sends answer 429 ``TooManyRequestsException``;
- ``+throttling400xN``: the first N answer 400 ``ThrottlingException`` (throttling as a 400);
- ``+500xN``: the first N answer 500 ``InternalServiceErrorException``;
- ``+reject``: 400 ``MessageRejected``; ``+paused``: 400 ``SendingPausedException``.
"""

import hmac
import json
import re
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from email_platform.sandbox.asgi import BackgroundServer

ACCESS_KEY = "AKIDSTUBEXAMPLE"
SECRET_KEY = "stub/secret/KEY+for+tests"
SEND_EMAIL_PATH = "/v2/email/outbound-emails"
MAX_SKEW_S = 300  # AWS refuses a signature more than five minutes off

_AUTHORIZATION = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/"
    r"(?P<service>[^/]+)/aws4_request, SignedHeaders=(?P<signed>[a-z0-9;-]+), "
    r"Signature=(?P<signature>[0-9a-f]{64})$"
)
_TAG = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
_HEADER_NAME = re.compile(r"^[!-9;-~]{1,126}$")
_HEADER_VALUE = re.compile(r"^[ -~]{1,995}$")
_FAULT = re.compile(r"\+(?P<kind>throttling400|throttle|500)x(?P<times>\d+)@")
_FAULTS = {
    "throttle": (429, "TooManyRequestsException", "Maximum sending rate exceeded."),
    "throttling400": (400, "ThrottlingException", "Rate exceeded"),
    "500": (500, "InternalServiceErrorException", "Internal service error."),
}


@dataclass
class SesStub:
    """``with SesStub() as stub: ... stub.base_url``; ``stub.messages`` is what SES accepted."""

    region: str = "us-east-1"
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: Every request as (status answered, error code or None, recipient or None).
    answers: list[tuple[int, str | None, str | None]] = field(default_factory=list)
    _seen: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: BackgroundServer | None = None

    def __enter__(self) -> "SesStub":
        app = Starlette(routes=[Route(SEND_EMAIL_PATH, self._send, methods=["POST"])])
        self._server = BackgroundServer(app)
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.stop()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return self._server.base_url

    def codes(self) -> list[str | None]:
        return [code for _, code, _ in self.answers]

    # ---- the endpoint -----------------------------------------------------------------------

    async def _send(self, request: Request) -> JSONResponse:
        raw = await request.body()
        refused = self._check_signature(request, raw)
        if refused is not None:
            return self._error(*refused)
        try:
            body = json.loads(raw)
        except ValueError:
            return self._error(400, "BadRequestException", "Request body is not valid JSON.")
        problem = _check_body(body)
        if problem is not None:
            return self._error(400, "BadRequestException", problem)
        to = body["Destination"]["ToAddresses"][0]
        with self._lock:
            self._seen[to] += 1
            seen = self._seen[to]
        fault = _FAULT.search(to)
        if fault and seen <= int(fault["times"]):
            return self._error(*_FAULTS[fault["kind"]], to=to)
        if "+reject@" in to:
            return self._error(
                400,
                "MessageRejected",
                "Email address is not verified. The following identities failed the check "
                f"in region {self.region.upper()}: {to}",
                to=to,
            )
        if "+paused@" in to:
            return self._error(
                400, "SendingPausedException", "Sending is paused for this account.", to=to
            )
        message_id = f"0100{uuid.uuid4().hex[:12]}-{uuid.uuid4()}-000000"
        simple = body["Content"]["Simple"]
        with self._lock:
            self.messages.append(
                {
                    "MessageId": message_id,
                    "from": body["FromEmailAddress"],
                    "to": body["Destination"]["ToAddresses"],
                    "subject": simple["Subject"]["Data"],
                    "text": simple["Body"].get("Text", {}).get("Data"),
                    "html": simple["Body"].get("Html", {}).get("Data"),
                    "headers": {h["Name"]: h["Value"] for h in simple.get("Headers", [])},
                    "tags": {t["Name"]: t["Value"] for t in body.get("EmailTags", [])},
                    "configuration_set": body.get("ConfigurationSetName"),
                    "x_amz_date": request.headers["x-amz-date"],
                }
            )
            self.answers.append((200, None, to))
        return JSONResponse({"MessageId": message_id})

    def _check_signature(self, request: Request, raw: bytes) -> tuple[int, str, str] | None:
        match = _AUTHORIZATION.match(request.headers.get("authorization", ""))
        if match is None:
            return 403, "MissingAuthenticationTokenException", "Missing Authentication Token"
        if match["key"] != self.access_key:
            return (
                403,
                "UnrecognizedClientException",
                "The security token included in the request is invalid.",
            )
        amz_date = request.headers.get("x-amz-date", "")
        signed = match["signed"].split(";")
        if "host" not in signed or "x-amz-date" not in signed:
            return 403, "InvalidSignatureException", "host and x-amz-date must be signed."
        if (match["region"], match["service"]) != (self.region, "ses"):
            return (
                403,
                "InvalidSignatureException",
                f"Credential should be scoped to a valid region and service 'ses', "
                f"not {match['region']}/{match['service']}.",
            )
        try:
            when = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
        except ValueError:
            return 403, "InvalidSignatureException", "X-Amz-Date is missing or malformed."
        if match["date"] != amz_date[:8]:
            return 403, "InvalidSignatureException", "Credential date does not match X-Amz-Date."
        if abs((datetime.now(UTC) - when).total_seconds()) > MAX_SKEW_S:
            return 403, "InvalidSignatureException", f"Signature expired: {amz_date}."
        # Recompute exactly what the client claims to have signed.
        headers = {name: request.headers.get(name, "") for name in signed}
        aws = AWSRequest(method=request.method, url=str(request.url), data=raw, headers=headers)
        aws.context["timestamp"] = amz_date
        signer = SigV4Auth(
            Credentials(self.access_key, self.secret_key), match["service"], match["region"]
        )
        expected = signer.signature(signer.string_to_sign(aws, signer.canonical_request(aws)), aws)
        if not hmac.compare_digest(expected, match["signature"]):
            return (
                403,
                "InvalidSignatureException",
                "The request signature we calculated does not match the signature you "
                "provided. Check your AWS Secret Access Key and signing method.",
            )
        return None

    def _error(
        self, status: int, code: str, message: str, *, to: str | None = None
    ) -> JSONResponse:
        with self._lock:
            self.answers.append((status, code, to))
        return JSONResponse(
            {"message": message},
            status_code=status,
            headers={
                "x-amzn-ErrorType": f"{code}:http://internal.amazon.com/coral/com.amazonaws.sesv2/",
                "x-amzn-RequestId": str(uuid.uuid4()),
            },
        )


def _check_body(body: Any) -> str | None:
    """What SES's request validation would refuse, or None."""
    if not isinstance(body, dict) or not isinstance(body.get("FromEmailAddress"), str):
        return "FromEmailAddress is required."
    to = (body.get("Destination") or {}).get("ToAddresses")
    if not isinstance(to, list) or not to:
        return "Destination.ToAddresses must name at least one recipient."
    simple = (body.get("Content") or {}).get("Simple")
    if not isinstance(simple, dict):
        return "Content.Simple is required for a simple message."
    if not isinstance((simple.get("Subject") or {}).get("Data"), str):
        return "Content.Simple.Subject.Data is required."
    parts = simple.get("Body") or {}
    if not parts.get("Text") and not parts.get("Html"):
        return "Content.Simple.Body needs Text or Html."
    for header in simple.get("Headers", []):
        if not _HEADER_NAME.fullmatch(header.get("Name", "")) or not _HEADER_VALUE.fullmatch(
            header.get("Value", "")
        ):
            return f"Invalid header {header!r}."
    for tag in body.get("EmailTags", []):
        if not _TAG.fullmatch(tag.get("Name", "")) or not _TAG.fullmatch(tag.get("Value", "")):
            return f"Invalid tag {tag!r}: only ASCII letters, numbers, '_' and '-' are allowed."
    return None
