"""Shared pieces of the hostile-input property tests: strategies for values a careless or
malicious caller could send, and signers for every webhook provider the receiver knows.

The signers compute what each provider documents (HMAC, ECDSA, RSA over SNS's string to sign,
HTTP basic auth) with test-only secrets, so a hostile body can be made authentic.
"""

import base64
import json
import math
import string
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from email_platform.webhooks import mailgun, registry, ses
from email_platform.webhooks.errors import WebhookRejected
from email_platform.webhooks.registry import WebhookProvider
from email_platform.webhooks.standard import sign as standard_sign


def hostile_settings(max_examples: int) -> settings:
    """Bounded, deadline-free, no example database written into the work tree."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )


# ---- text --------------------------------------------------------------------------------------


def _b64_word(text: str) -> str:
    return f"=?utf-8?b?{base64.b64encode(text.encode('utf-8')).decode()}?="


#: Charsets written into generated RFC 2047 encoded words.
ENCODED_WORD_CHARSETS = (
    "utf-8",
    "UTF-8",
    "us-ascii",
    "iso-8859-1",
    "utf-16",
    "utf-7",
    "latin-1",
    "koi8-r",
    "bogus-charset",
    "",
    "rot13",
    "zlib",
    "hex",
    "unicode_escape",
    "raw_unicode_escape",
)
SPECIAL_TEXT = (
    "",
    " ",
    "\x00",
    "a\x00b",
    "\ud800",
    "x\udfffy",
    "\udc80\udcff",
    "\r",
    "\n",
    "\r\n",
    "Jane\r\nBcc: x@y.z",
    "Jane\nBcc: x@y.z",
    "\u2028",
    "Jane\u2028Bcc: x@y.z",
    "\u2029",
    "\x85",
    "\x7f",
    "\x1b[31m",
    "\t",
    "\ufeff",
    "\u200b",
    "\U0001f642",
    "é",
    "=?utf-8?q?Jane=0D=0ABcc:_x@y.z?=",
    "=?UTF-8?Q?Jane=0ABcc:_x@y.z?=",
    "=?utf-8?q?=E2=80=A8?=",
    "=?utf-8?q?=C2=85?=",
    "=?iso-8859-1?q?=0D?=",
    "=?utf-8?q?=00?=",
    _b64_word("Jane\r\nBcc: x@y.z"),
    _b64_word("\u2028"),
    _b64_word(_b64_word("Jane\r\nBcc: x@y.z")),  # an encoded word inside an encoded word
    "=?utf-8?q?" + "=3D=3Futf-8=3Fq=3F=0A=3F=3D" + "?=",
    "=?utf-8?b?!!!?=",
    "=?utf-8?q?",
    "=?",
    "?=",
    "=?bogus?x?abc?=",
    "{user_id}",
    "{0}",
    "{",
    "}",
    "%s",
    "' OR 1=1 --",
    "\\",
    '"',
    "null",
)
#: Column limits (26, 200, 255, 320) and the address limit (254), each side.
LENGTHS = (25, 26, 27, 63, 64, 65, 199, 200, 201, 253, 254, 255, 256, 319, 320, 321)
_FILL = ("a", "Z", "é", "\U0001f642", "\x00", "\ud800", "=", "\n", " ", ".", "@")


@st.composite
def encoded_words(draw: st.DrawFn) -> str:
    """RFC 2047 encoded words whose decoded text may hold a line break or a control."""
    inner = draw(st.one_of(st.sampled_from(SPECIAL_TEXT), st.text(max_size=20)))
    charset = draw(st.sampled_from(ENCODED_WORD_CHARSETS))
    if draw(st.booleans()):
        try:
            raw = inner.encode("utf-8")
        except UnicodeEncodeError:
            raw = inner.encode("utf-8", "surrogatepass")
        return f"=?{charset}?b?{base64.b64encode(raw).decode()}?="
    quoted = "".join(
        c if c in string.ascii_letters + string.digits else f"={b:02X}"
        for c in inner
        for b in c.encode("utf-8", "surrogatepass")
    )
    return f"=?{charset}?{draw(st.sampled_from('qQ'))}?{quoted}?="


long_text = st.builds(lambda n, c: (c * n)[:n], st.sampled_from(LENGTHS), st.sampled_from(_FILL))

hostile_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(SPECIAL_TEXT),
    long_text,
    encoded_words(),
    st.lists(
        st.one_of(st.sampled_from(SPECIAL_TEXT), st.text(max_size=8), encoded_words()),
        min_size=2,
        max_size=5,
    ).map("".join),
)


# ---- values of every type ------------------------------------------------------------------


class RaisingTz(tzinfo):
    """A caller's tzinfo that fails when asked for its offset."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        raise RuntimeError("this tzinfo is broken")

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str:
        return "BROKEN"


class NoOffsetTz(tzinfo):
    """A tzinfo that says it has no offset: the datetime is naive in all but name."""

    def utcoffset(self, dt: datetime | None) -> None:
        return None

    def dst(self, dt: datetime | None) -> None:
        return None


class WrongTypeTz(tzinfo):
    """A tzinfo whose offset is not a timedelta."""

    def utcoffset(self, dt: datetime | None) -> Any:
        return 3600

    def dst(self, dt: datetime | None) -> None:
        return None


#: Fixed offsets down to the microsecond, inside the +-24 h a ``timezone`` allows.
odd_offsets = st.timedeltas(
    min_value=-timedelta(hours=23, minutes=59, seconds=59, microseconds=999999),
    max_value=timedelta(hours=23, minutes=59, seconds=59, microseconds=999999),
).map(timezone)

_EXTREMES = (
    datetime.min,
    datetime.max,
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))),
    datetime(1, 1, 1, tzinfo=timezone(-timedelta(hours=23, minutes=59))),
    datetime(9999, 12, 31, 23, tzinfo=timezone(-timedelta(hours=5))),
    datetime(9999, 12, 31, 20, tzinfo=timezone(timedelta(hours=5))),
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(2038, 1, 19, 3, 14, 8, tzinfo=UTC),
    datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(2030, 3, 31, 2, 30, tzinfo=timezone(timedelta(hours=14))),
    datetime(2024, 2, 29, tzinfo=timezone(timedelta(seconds=1))),
)
#: Built when drawn: hashing a datetime (which sampled_from does) asks the tzinfo its offset.
broken_tz_datetimes = st.sampled_from([RaisingTz, NoOffsetTz, WrongTypeTz]).map(
    lambda tz: datetime(2025, 1, 1, tzinfo=tz())
)

hostile_datetimes = st.one_of(
    st.sampled_from(_EXTREMES),
    broken_tz_datetimes,
    st.datetimes(),  # naive
    st.datetimes(timezones=st.one_of(odd_offsets, st.just(UTC))),
    st.datetimes(timezones=st.timezones()),  # zoneinfo, DST gaps and folds included
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)).map(
        lambda d: d.replace(tzinfo=UTC)
    ),
)


class HugeInt(int):
    """``10**digits``, an int too long for ``str()`` (Python's 4300-digit limit), shown short."""

    def __new__(cls, digits: int) -> "HugeInt":
        value = super().__new__(cls, 10**digits)
        value.digits = digits
        return value

    def __repr__(self) -> str:
        return f"10**{self.digits}"


huge_integers = st.one_of(
    st.integers(),
    st.sampled_from(
        [
            0,
            -1,
            1,
            2**31 - 1,
            2**31,
            -(2**31),
            -(2**31) - 1,
            2**63 - 1,
            2**63,
            -(2**63),
            -(2**63) - 1,
            2**64,
        ]
    ),
    # 10**100, and past Python's 4300-digit int-to-str limit
    st.builds(HugeInt, st.sampled_from([100, 4299, 4300, 5000])),
    st.integers(min_value=2**63, max_value=2**200),
    st.integers(min_value=-(2**200), max_value=-(2**63)),
)

odd_floats = st.one_of(
    st.floats(),  # nan and inf included
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308]),
)


class _ShortRepr:
    """Shown as ``nest(depth, kind, leaf)``: printing 2000 levels would exhaust the stack."""

    shown = ""

    def __repr__(self) -> str:
        return self.shown

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.shown)


class DeepDict(_ShortRepr, dict):
    pass


class DeepList(_ShortRepr, list):
    pass


def nest(depth: int, kind: str, leaf: Any = "x") -> Any:
    """``leaf`` inside ``depth`` levels of dicts, lists or both, built without recursion. The
    outermost level is a ``dict``/``list`` subclass that prints short."""
    value = leaf
    for level in range(depth - 1):
        as_list = kind == "list" or (kind == "mixed" and level % 2)
        value = [value] if as_list else {"k": value}
    outer = DeepList([value]) if kind == "list" else DeepDict(k=value)
    outer.shown = f"nest({depth}, {kind!r}, {leaf!r})"
    return outer


deep_values = st.builds(
    nest,
    st.one_of(
        st.sampled_from([30, 31, 32, 33, 34, 100, 999, 1000, 1001, 2000]),
        st.integers(min_value=30, max_value=2000),
    ),
    st.sampled_from(["dict", "list", "mixed"]),
    st.sampled_from(["x", 1, None, "\x00", "\ud800"]),
)

odd_keys = st.one_of(
    hostile_text,
    huge_integers,
    st.booleans(),
    st.none(),
    odd_floats,
    st.tuples(st.integers(), st.text(max_size=3)),
    st.binary(max_size=4),
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    huge_integers,
    odd_floats,
    hostile_text,
    st.binary(max_size=40),
    hostile_datetimes,
    st.sampled_from([object(), {1, 2}, frozenset(), 1j, Ellipsis, b"\x00", bytearray(b"x")]),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(hostile_text, children, max_size=4),
        st.dictionaries(odd_keys, children, max_size=3),
    )


hostile_values = st.one_of(
    st.recursive(scalars, _containers, max_leaves=12),
    deep_values,
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    hostile_text,
)
#: Values ``json.dumps`` can write (text may still hold NUL or lone surrogates).
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(hostile_text, children, max_size=4)
    ),
    max_leaves=10,
)


# ---- webhook bodies ------------------------------------------------------------------------


#: Body text no JSON parser should enjoy.
JSON_TRAPS = (
    b"",
    b" ",
    b"null",
    b"true",
    b"0",
    b"-0",
    b"1e999999",
    b"-1e999999",
    b"NaN",
    b"Infinity",
    b"[NaN, -Infinity]",
    b"9" * 5000,  # past Python's int-from-str digit limit
    b"[" + b"9" * 5000 + b"]",
    b'"\\u0000"',
    b'{"a": "\\u0000"}',
    b'{"a": "\\ud800"}',
    b'{"\\u0000": 1}',
    b'{"a": 1, "a": 2}',
    b"[" * 100000,  # deeper than any recursion limit
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark
    b"\xff\xfe{\x00}\x00",  # UTF-16
    b'{"a": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8 (CESU-8): invalid UTF-8
    b'{"a": "\xc3\x28"}',  # an invalid two-byte sequence
    b"\x00",
    b"{\x00}",
    b'{"type": "email.delivered"}\x00',
    b"\x80\x81\x82",
    b"<xml/>",
    b"timestamp=1&token=x&signature=y",
)

hostile_bytes = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(JSON_TRAPS),
    hostile_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
    json_values.map(lambda v: json.dumps(v).encode()),  # lone surrogates as \\u escapes
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")),
)

#: Timestamps no clock reads: hundreds of digits, negative, non-numeric, far future.
absurd_timestamps = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "0",
            "-1",
            "-" + "9" * 300,
            "9" * 300,
            "1" * 4301,
            str(2**63),
            str(2**64),
            "99999999999",
            "253402300800",  # year 10000
            "1e10",
            "1.5",
            "nan",
            "inf",
            "0x10",
            "1_700_000_000",
            " 1700000000 ",
            "+1700000000",
            "\u0661\u0667\u0660\u0660",  # Arabic-Indic digits, which int() reads
            "soon",
            "2026-01-01T00:00:00Z",
            "\x00",
        ]
    ),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    hostile_text,
)

#: Delivery ids: empty, long (thousands of characters), with controls. ASCII: the test client
#: re-encodes header text as UTF-8, so other characters would not arrive as sent.
hostile_ids = st.one_of(
    st.sampled_from(["", " ", "\x00", "a\x00b", "\r\n", "\x7f", "msg_1", "sha256:" + "0" * 64]),
    st.integers(min_value=255, max_value=6000).map(lambda n: "m" * n),
    st.text(alphabet=st.characters(codec="ascii", exclude_characters="\r\n"), max_size=40),
)


def header_value(text: str) -> bytes:
    """``text`` as raw header bytes (HTTP headers are Latin-1 on the wire)."""
    return text.encode("latin-1", "replace")


# ---- signers -------------------------------------------------------------------------------

SANDBOX_SECRET = "whsec_" + base64.b64encode(b"hostile-sandbox-secret").decode()
RESEND_SECRET = "whsec_" + base64.b64encode(b"hostile-resend-secret").decode()
MAILGUN_KEY = "hostile-mailgun-signing-key"
POSTMARK_USER, POSTMARK_PASSWORD = "hostile-hooks", "pass:word"
SENDGRID_KEY = ec.generate_private_key(ec.SECP256R1())
SES_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
SES_TOPIC = "arn:aws:sns:us-east-1:123456789012:hostile-ses-events"
SES_CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-hostile.pem"


def _ses_certificate() -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sns.amazonaws.com")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(SES_KEY.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=365))
        .sign(SES_KEY, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM)


SES_CERT_PEM = _ses_certificate()

WEBHOOK_SETTINGS = {
    "sandbox_webhook_secret": SANDBOX_SECRET,
    "resend_webhook_secret": RESEND_SECRET,
    "mailgun_webhook_signing_key": MAILGUN_KEY,
    "postmark_webhook_user": POSTMARK_USER,
    "postmark_webhook_password": POSTMARK_PASSWORD,
    "sendgrid_webhook_public_key": base64.b64encode(
        SENDGRID_KEY.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    ).decode(),
    "ses_webhook_topic_arns": SES_TOPIC,
}


def _fetch_certificate(url: str) -> bytes:
    if url == SES_CERT_URL:
        return SES_CERT_PEM
    raise WebhookRejected(f"{url} answered 404")


def _confirm(url: str) -> None:
    return None


def webhook_providers() -> dict[str, WebhookProvider]:
    """Every provider as the receiver loads it; SES fetches its certificate from here."""
    providers = {name: registry.get(name) for name in registry.NAMES if name != "ses"}
    providers["ses"] = WebhookProvider(
        "ses",
        lambda s: ses.build_verifier(s, fetcher=_fetch_certificate, confirmer=_confirm),
        ses.normalize,
    )
    return providers


def now_s() -> int:
    return int(time.time())


def standard_headers(
    prefix: str, secret: str, webhook_id: str, body: bytes, timestamp: int | None = None
) -> dict[str, Any]:
    """Standard Webhooks headers (``webhook-*``; Svix names them ``svix-*`` for Resend)."""
    stamp = now_s() if timestamp is None else timestamp
    return {
        "content-type": "application/json",
        f"{prefix}-id": header_value(webhook_id),
        f"{prefix}-timestamp": str(stamp),
        f"{prefix}-signature": standard_sign(secret, webhook_id, stamp, body),
    }


def mailgun_body(
    outer: Any, token: str, timestamp: str | None = None, key: str = MAILGUN_KEY
) -> bytes:
    """``outer`` (a JSON object) with a signature block computed as Mailgun does."""
    stamp = str(now_s()) if timestamp is None else timestamp
    block = {"timestamp": stamp, "token": token, "signature": mailgun.sign(key, stamp, token)}
    return json.dumps({**outer, "signature": block}).encode()


def basic_auth(user: str = POSTMARK_USER, password: str = POSTMARK_PASSWORD) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"authorization": f"Basic {token}", "content-type": "application/json"}


def sendgrid_headers(body: bytes, timestamp: str | None = None) -> dict[str, str]:
    stamp = str(now_s()) if timestamp is None else timestamp
    signature = SENDGRID_KEY.sign(stamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return {
        "content-type": "application/json",
        "x-twilio-email-event-webhook-signature": base64.b64encode(signature).decode(),
        "x-twilio-email-event-webhook-timestamp": stamp,
    }


def sns_string_to_sign(message: dict[str, Any]) -> bytes:
    """https://docs.aws.amazon.com/sns/latest/dg/sns-verify-signature-of-message.html"""
    if message["Type"] == "Notification":
        names = ["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"]
    else:
        names = ["Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type"]
    return "".join(f"{n}\n{message[n]}\n" for n in names if n in message).encode()


def sns_timestamp(moment: datetime | None = None) -> str:
    moment = (moment or datetime.now(UTC)).astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def sns_notification(
    message_text: str, *, message_id: str | None = None, subject: str | None = None, **extra: Any
) -> dict[str, Any]:
    """A signed SNS ``Notification`` carrying ``message_text``, as SNS sends SES events."""
    message: dict[str, Any] = {
        "Type": "Notification",
        "MessageId": str(uuid.uuid4()) if message_id is None else message_id,
        "TopicArn": SES_TOPIC,
        "Message": message_text,
        "Timestamp": sns_timestamp(),
        "SignatureVersion": "2",
        "SigningCertURL": SES_CERT_URL,
        **extra,
    }
    if subject is not None:
        message["Subject"] = subject
    signature = SES_KEY.sign(sns_string_to_sign(message), padding.PKCS1v15(), hashes.SHA256())
    return {**message, "Signature": base64.b64encode(signature).decode()}


def sns_headers(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "content-type": "text/plain; charset=UTF-8",
        "x-amz-sns-message-type": header_value(str(message.get("Type"))),
        "x-amz-sns-message-id": header_value(str(message.get("MessageId"))),
        "x-amz-sns-topic-arn": header_value(str(message.get("TopicArn"))),
    }


# ---- documents with a few values broken ----------------------------------------------------

#: Numbers a JSON parser returns and a normalizer may choke on (Python's json writes and reads
#: NaN and Infinity).
ODD_NUMBERS = (
    10**400,
    -(10**400),
    10**4000,
    1e308,
    -1e308,
    math.inf,
    -math.inf,
    math.nan,
    -0.0,
    5e-324,
    2**63,
    -(2**63) - 1,
    -1,
    0,
    True,
    False,
    1.5,
)


def _slots(document: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) of a JSON tree, walked without recursion."""
    slots: list[tuple[Any, Any]] = []
    stack = [document]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            slots.append((node, key))
            if isinstance(value, dict | list):
                stack.append(value)
    return slots


def one_of_documents(documents: list[Any]) -> st.SearchStrategy[Any]:
    """``sampled_from(documents)``, without printing every document in the strategy's repr."""
    return st.sampled_from(range(len(documents))).map(documents.__getitem__)


@st.composite
def mutated(draw: st.DrawFn, document: Any) -> Any:
    """A copy of ``document`` with one to four values replaced, removed, wrapped or renamed."""
    copy = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        slots = _slots(copy) if isinstance(copy, dict | list) else []
        if not slots:
            break
        parent, key = slots[draw(st.integers(min_value=0, max_value=len(slots) - 1))]
        how = draw(st.sampled_from(["replace", "replace", "number", "delete", "wrap", "rename"]))
        if how == "delete":
            del parent[key]
        elif how == "wrap":
            parent[key] = draw(st.sampled_from([[parent[key]], {"value": parent[key]}]))
        elif how == "number":
            parent[key] = draw(st.sampled_from(ODD_NUMBERS))
        elif how == "rename" and isinstance(parent, dict):
            parent[draw(hostile_text)] = parent.pop(key)
        else:
            parent[key] = draw(json_values)
    return copy
