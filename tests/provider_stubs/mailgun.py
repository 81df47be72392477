"""A Mailgun Messages API stand-in: ``POST /v3/{domain}/messages`` with basic auth
(``api:<key>``), form fields, Mailgun's answers and error bodies, recording what it received.

Faults come from the recipient's local part: ``+fail429x2`` answers 429 with ``Retry-After``
to the first two requests for that address, ``+fail503x1`` / ``+fail500x1`` answer 5xx once,
and ``+invalid`` always answers Mailgun's 400 for a bad ``to``. Mailgun has no idempotency
key, so failures are counted per recipient address. Urlencoded forms are parsed (what the
adapter sends), and multipart forms, which the adapter sends only with attachments (files
recorded under ``attachment``); any other encoding is refused with a 400.
"""

import base64
import re
import secrets
import time
from collections import Counter
from email.parser import BytesParser
from email.policy import HTTP
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

_FAIL_RE = re.compile(r"\+fail(429|500|503)x(\d+)")
INVALID_TO = "'to' parameter is not a valid address. please check documentation"


def _message(status: int, message: str, **headers: str) -> Response:
    return JSONResponse({"message": message}, status_code=status, headers=headers)


async def _multipart(request: Request) -> dict:
    """Fields as in a urlencoded form; each file as ``{"filename", "content_type", "content"}``
    under its field name (``attachment``), always a list. Parsed with the standard library's
    MIME parser (the stub's server has no multipart extra)."""
    head = f"Content-Type: {request.headers['content-type']}\r\n\r\n".encode()
    parsed = BytesParser(policy=HTTP).parsebytes(head + await request.body())
    found: dict = {}
    for part in parsed.iter_parts():
        name = part.get_param("name", header="content-disposition")
        content = part.get_payload(decode=True)
        value = (
            {
                "filename": part.get_filename(),
                "content_type": part.get_content_type(),
                "content": content,
            }
            if part.get_filename()
            else content.decode()
        )
        found.setdefault(name, []).append(value)
    return {k: v[0] if len(v) == 1 and k != "attachment" else v for k, v in found.items()}


class MailgunStub:
    """``with BackgroundServer(stub.app) as url:``; then read ``requests`` and ``accepted``.

    Each recorded form maps a field name to its single value (or list of values if repeated).
    """

    def __init__(
        self,
        api_key: str = "key-test",
        domain: str = "mg.example.com",
        *,
        retry_after: str = "1",
    ) -> None:
        self.api_key = api_key
        self.domain = domain
        self.retry_after = retry_after
        self.requests: list[dict] = []  # every authenticated request: headers and form
        self.accepted: list[dict] = []  # {"id", "form"} of each 200
        self._failed: Counter[str] = Counter()
        self._sequence = 0
        self.app = Starlette(routes=[Route("/v3/{domain}/messages", self._send, methods=["POST"])])

    def _authorized(self, header: str | None) -> bool:
        expected = base64.b64encode(f"api:{self.api_key}".encode()).decode()
        return header == f"Basic {expected}"

    async def _send(self, request: Request) -> Response:
        if not self._authorized(request.headers.get("authorization")):
            return PlainTextResponse("Forbidden", status_code=401)
        domain = request.path_params["domain"]
        if domain != self.domain:
            return _message(404, f"Domain not found: {domain}")
        content_type = request.headers.get("content-type") or ""
        if content_type.startswith("multipart/form-data; boundary="):  # a message with files
            form = await _multipart(request)
        elif content_type == "application/x-www-form-urlencoded":
            raw = parse_qs((await request.body()).decode(), keep_blank_values=True)
            form = {k: v[0] if len(v) == 1 else v for k, v in raw.items()}
        else:
            return _message(400, "stub parses urlencoded forms and multipart with files only")
        self.requests.append({"headers": dict(request.headers), "form": form})
        for required in ("from", "to", "subject"):
            if not form.get(required):
                return _message(400, f"'{required}' parameter is missing")
        if not any(form.get(part) for part in ("text", "html", "template")):
            return _message(400, "Need at least one of 'text', 'html' or 'template' parameters")
        to = str(form["to"])
        local = to.partition("@")[0]
        if "+invalid" in local or "@" not in to:
            return _message(400, INVALID_TO)
        fault = _FAIL_RE.search(local)
        if fault and self._failed[to] < int(fault.group(2)):
            self._failed[to] += 1
            if fault.group(1) == "429":
                return _message(429, "Too many requests", **{"Retry-After": self.retry_after})
            return _message(int(fault.group(1)), "Internal Server Error")
        self._sequence += 1
        message_id = (
            f"{time.strftime('%Y%m%d%H%M%S', time.gmtime())}.{self._sequence}."
            f"{secrets.token_hex(8).upper()}@{domain}"
        )
        self.accepted.append({"id": message_id, "form": form})
        return JSONResponse({"id": f"<{message_id}>", "message": "Queued. Thank you."})
