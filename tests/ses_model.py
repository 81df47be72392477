"""AWS's own SES v2 ``SendEmail`` model (from botocore), as a checker for request bodies.

``send_email_problems(body)`` lists every way a JSON body breaks the model:

- botocore's ``ParamValidator``: required members, types, minimums, unknown members;
- what that validator leaves unchecked though the model states it: maximum lengths and list
  sizes, ``pattern`` and ``enum`` traits;
- the rules the model states in its documentation text: an address's local part is 7-bit
  ASCII and its domain Punycode (the ``Destination`` shape; ``FromEmailAddress`` is a header
  SES writes the same way), tag names and values are ``[A-Za-z0-9_-]`` and at most 256
  characters (``MessageTag``), and a content whose data is not ASCII names its ``Charset``
  (``Content.Charset``).

``botocore_body(body)`` is the body botocore's own rest-json serializer writes for the same
parameters: a body equal to it uses the model's member names and nesting exactly.
"""

import json
import re
from typing import Any

import botocore.session
from botocore.model import Shape
from botocore.serialize import create_serializer
from botocore.validate import ParamValidator

from email_platform.providers.base import OutgoingEmail

MODEL = botocore.session.get_session().get_service_model("sesv2")
SEND_EMAIL = MODEL.operation_model("SendEmail")
_TAG = re.compile(r"[A-Za-z0-9_-]{1,256}")
_ADDRESS_SHAPE = "EmailAddress"


#: The event the SES tests' messages belong to.
EVENT_ID = "01JDQ5Z3K8M9N0P1Q2R3S4T5V6"


def outgoing(**overrides) -> OutgoingEmail:  # type: ignore[no-untyped-def]
    """A welcome message as the send path hands it to the SES adapter, with ``overrides``."""
    values = {
        "message_id": 7,
        "event_id": EVENT_ID,
        "idempotency_key": f"{EVENT_ID}:welcome",
        "sender": "Example <no-reply@example.com>",
        "to": "jane@example.com",
        "subject": "Welcome, Jane",
        "text": "Hello Jane",
        "html": "<p>Hello Jane</p>",
        "template": "welcome",
        "lane": "transactional",
        "headers": {"X-Email-Event-Id": EVENT_ID},
    }
    values.update(overrides)
    return OutgoingEmail(**values)


def documented_rules() -> str:
    """The model's own words for the address and tag rules checked here (so a test can show
    they are still what AWS documents)."""
    return " ".join(
        [
            MODEL.shape_for("Destination").documentation,
            MODEL.shape_for("MessageTag").members["Value"].documentation,
            MODEL.shape_for("Content").members["Charset"].documentation,
        ]
    )


def send_email_problems(body: dict[str, Any]) -> list[str]:
    """Every way ``body`` (a parsed ``SendEmail`` JSON body) breaks AWS's model; [] if none."""
    report = ParamValidator().validate(body, SEND_EMAIL.input_shape)
    problems = [report.generate_report()] if report.has_errors() else []
    _walk(body, SEND_EMAIL.input_shape, "SendEmail", problems)
    return problems


def botocore_body(body: dict[str, Any]) -> dict[str, Any]:
    """What botocore's serializer sends for these parameters, parsed back."""
    request = create_serializer("rest-json").serialize_to_request(body, SEND_EMAIL)
    assert request["method"] == "POST" and request["url_path"] == "/v2/email/outbound-emails"
    return json.loads(request["body"])


def _walk(value: Any, shape: Shape, where: str, problems: list[str]) -> None:
    meta = shape.metadata
    if shape.type_name == "structure" and isinstance(value, dict):
        for name, member in value.items():
            if name in shape.members:
                _walk(member, shape.members[name], f"{where}.{name}", problems)
        if shape.name == "MessageTag":
            for part in ("Name", "Value"):
                if not _TAG.fullmatch(str(value.get(part, ""))):
                    problems.append(f"{where}.{part}: {value.get(part)!r} breaks the tag rules")
        data = str(value.get("Data", ""))
        if shape.name == "Content" and not data.isascii() and not value.get("Charset"):
            problems.append(f"{where}: non-ASCII data without a Charset")
    elif shape.type_name == "list" and isinstance(value, list):
        if "max" in meta and len(value) > meta["max"]:
            problems.append(f"{where}: {len(value)} items, the model allows {meta['max']}")
        for index, item in enumerate(value):
            _walk(item, shape.member, f"{where}[{index}]", problems)
    elif shape.type_name == "string" and isinstance(value, str):
        if "max" in meta and len(value) > meta["max"]:
            problems.append(f"{where}: {len(value)} characters, the model allows {meta['max']}")
        if "pattern" in meta and not re.search(meta["pattern"], value):
            problems.append(f"{where}: {value!r} does not match {meta['pattern']!r}")
        if "enum" in meta and value not in meta["enum"]:
            problems.append(f"{where}: {value!r} is not one of {meta['enum']}")
        if shape.name == _ADDRESS_SHAPE and not value.isascii():
            # Destination's text: no SMTPUTF8, so an ASCII local part; a Punycode domain.
            problems.append(f"{where}: {value!r} is not ASCII (Punycode domain, ASCII local)")
