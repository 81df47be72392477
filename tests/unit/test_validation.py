"""Unit tests of what ``publish()`` refuses synchronously, and that it refuses it first.

Every bad input must raise a ``PublishError`` subclass (a ``ValueError`` with ``.field`` naming
the field) BEFORE the database is touched. The proof: each rejection runs on a connection to an
in-memory SQLite database that has no tables at all, inside ``engine.begin()``. Had ``publish()``
reached the outbox insert, it would have raised ``OperationalError`` (no such table) instead -
the control test below shows exactly that for a valid event. Only the ``NotInTransactionError``
tests use a migrated database (a SQLite file under ``tmp_path``).
"""

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, func, inspect, select
from sqlalchemy.exc import OperationalError

from email_platform import publish
from email_platform.common.errors import (
    HeaderInjectionError,
    InvalidAddressError,
    InvalidPayloadError,
    NotInTransactionError,
    PublishError,
    UnknownPriorityError,
)
from email_platform.common.ids import is_ulid
from email_platform.common.lanes import Lane
from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import email_outbox
from email_platform.publishing import validation

SIGNED_UP = {"user_id": "user_abc123", "email": "jane@example.com", "first_name": "Jane"}
RESET = {"user_id": "user_abc123", "reset_token": "tok_123"}
NOW = datetime.now(UTC)


@pytest.fixture
def tableless() -> Iterator[Connection]:
    """A connection in an open transaction on a database with no tables whatsoever."""
    engine = create_engine("sqlite://")
    with engine.begin() as connection:
        yield connection
    engine.dispose()


@pytest.fixture
def migrated(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'app.sqlite3'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def _signed_up(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "event_type": "user.signed_up",
        "aggregate_id": "user_abc123",
        "payload": dict(SIGNED_UP),
    }
    kwargs.update(overrides)
    return kwargs


def _with_payload(**fields: Any) -> dict[str, Any]:
    """``user.signed_up`` kwargs with some payload fields replaced; ``None`` removes a field."""
    payload = {**SIGNED_UP, **fields}
    return _signed_up(payload={k: v for k, v in payload.items() if v is not None})


def _reject(
    connection: Connection, error: type[PublishError], field: str, **kwargs: Any
) -> PublishError:
    """Publish, expect ``error`` on ``field``, and check the database was never needed."""
    with pytest.raises(error) as info:
        publish(connection, **kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert inspect(connection).get_table_names() == []
    return info.value


# --- the control: the tableless fixture really would expose a database access -----------------


def test_valid_event_reaches_the_database_and_fails_there_on_the_tableless_fixture(
    tableless: Connection,
) -> None:
    with pytest.raises(OperationalError, match="email_outbox"):
        publish(tableless, **_signed_up())


def test_valid_event_is_written_in_the_callers_transaction(migrated: Engine) -> None:
    with migrated.begin() as connection:
        event_id = publish(
            connection,
            event_type="user.password_reset_requested",
            aggregate_id="user_abc123",
            payload=RESET,
        )
        row = connection.execute(
            select(email_outbox).where(email_outbox.c.event_id == event_id)
        ).one()
    assert is_ulid(event_id)
    assert row.event_type == "user.password_reset_requested"
    assert row.lane == Lane.CRITICAL.value  # the route's lane, not the default
    assert row.payload == RESET
    assert row.status == "pending"


# --- recipient address syntax ---------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "not-an-address",
        "jane@",
        "@example.com",
        "jane@example",
        "jane doe@example.com",
        "jane@@example.com",
        "jane@exa mple.com",
        "x" * 65 + "@example.com",
        "",
    ],
)
def test_bad_recipient_address_is_invalid_address(tableless: Connection, address: str) -> None:
    _reject(tableless, InvalidAddressError, "payload.email", **_with_payload(email=address))


@pytest.mark.parametrize("address", [None, 42, ["jane@example.com"]])
def test_non_string_recipient_is_invalid_address(tableless: Connection, address: Any) -> None:
    payload = {**SIGNED_UP, "email": address}
    _reject(tableless, InvalidAddressError, "payload.email", **_signed_up(payload=payload))


def test_missing_required_recipient_field(tableless: Connection) -> None:
    error = _reject(tableless, InvalidPayloadError, "payload.email", **_with_payload(email=None))
    assert "user.signed_up" in str(error)


def test_over_long_address_is_refused(tableless: Connection) -> None:
    address = "jane@" + ".".join(["a" * 60] * 6) + ".com"  # > 320 characters
    assert len(address) > 320
    _reject(tableless, InvalidAddressError, "payload.email", **_with_payload(email=address))


# --- CR/LF in anything that ends up in a header -------------------------------------------------


@pytest.mark.parametrize(
    "address", ["jane@example.com\r\nBcc: victim@example.org", "jane@example.com\n", "\rjane@x.io"]
)
def test_recipient_with_line_break_is_header_injection(tableless: Connection, address: str) -> None:
    _reject(tableless, HeaderInjectionError, "payload.email", **_with_payload(email=address))


@pytest.mark.parametrize("event_type", ["user.signed_up", "order.paid", "digest.ready"])
@pytest.mark.parametrize("name", ["Jane\r\nBcc: victim@example.org", "Jane\n", "Ja\rne"])
def test_header_field_with_line_break_is_header_injection(
    tableless: Connection, event_type: str, name: str
) -> None:
    kwargs = _signed_up(event_type=event_type, payload={**SIGNED_UP, "first_name": name})
    _reject(tableless, HeaderInjectionError, "payload.first_name", **kwargs)


def test_line_breaks_outside_header_fields_are_allowed(tableless: Connection) -> None:
    # A multi-line body field is legitimate; only header-bound fields are refused. The call gets
    # past validation and fails on the (absent) outbox table.
    payload = {**SIGNED_UP, "bio": "line one\nline two\r\n"}
    with pytest.raises(OperationalError):
        publish(tableless, **_signed_up(payload=payload))


def test_aggregate_id_with_line_break_is_header_injection(tableless: Connection) -> None:
    _reject(tableless, HeaderInjectionError, "aggregate_id", **_signed_up(aggregate_id="u\r\n1"))


@pytest.mark.parametrize("key", ["key\r\nX-Evil: 1", "key\n", "\rkey"])
def test_idempotency_key_with_line_break_is_header_injection(
    tableless: Connection, key: str
) -> None:
    _reject(tableless, HeaderInjectionError, "idempotency_key", **_signed_up(idempotency_key=key))


@pytest.mark.parametrize("key", ["", "k" * 201, 123])
def test_bad_idempotency_key(tableless: Connection, key: Any) -> None:
    _reject(tableless, PublishError, "idempotency_key", **_signed_up(idempotency_key=key))


def test_metadata_value_with_line_break_is_header_injection(tableless: Connection) -> None:
    metadata = {"producer": "accounts", "trace_id": "abc\r\ndef"}
    _reject(tableless, HeaderInjectionError, "metadata.trace_id", **_signed_up(metadata=metadata))


def test_metadata_must_be_an_object(tableless: Connection) -> None:
    _reject(tableless, InvalidPayloadError, "metadata", **_signed_up(metadata=["a", "b"]))


# --- payload shape ----------------------------------------------------------------------------


@pytest.mark.parametrize("payload", [None, ["jane@example.com"], "jane@example.com", 42])
def test_payload_must_be_an_object(tableless: Connection, payload: Any) -> None:
    error = _reject(tableless, InvalidPayloadError, "payload", **_signed_up(payload=payload))
    assert type(payload).__name__ in str(error)


@pytest.mark.parametrize(
    "bad",
    [datetime(2026, 1, 1, tzinfo=UTC), object(), {1, 2}, b"bytes", float("nan"), float("inf")],
    ids=["datetime", "object", "set", "bytes", "nan", "inf"],
)
def test_payload_must_be_json_serializable(tableless: Connection, bad: Any) -> None:
    error = _reject(
        tableless, InvalidPayloadError, "payload", **_with_payload(extra={"nested": bad})
    )
    assert "JSON-serializable" in str(error)


def _padded(total_bytes: int) -> dict[str, Any]:
    """An unrouted event's payload whose JSON encoding is exactly ``total_bytes`` long."""
    overhead = len(json.dumps({"pad": ""}))
    payload = {"pad": "x" * (total_bytes - overhead)}
    assert len(json.dumps(payload).encode()) == total_bytes
    return payload


def test_payload_over_64_kib_is_refused(tableless: Connection) -> None:
    kwargs = {"event_type": "audit.note_added", "aggregate_id": "a1"}
    error = _reject(tableless, InvalidPayloadError, "payload", payload=_padded(65537), **kwargs)
    assert "65537" in str(error)


def test_payload_of_exactly_64_kib_passes_validation(tableless: Connection) -> None:
    # The limit is inclusive: this one gets past validation and fails on the missing table.
    with pytest.raises(OperationalError):
        publish(tableless, event_type="cart.viewed", aggregate_id="a1", payload=_padded(65536))


def test_payload_size_is_measured_on_the_json_encoding(tableless: Connection) -> None:
    # 11,000 characters, but JSON escapes each as \u00e9: 66,000+ bytes encoded, over 64 KiB.
    payload = {"note": "\u00e9" * 11_000}
    _reject(
        tableless,
        InvalidPayloadError,
        "payload",
        event_type="audit.note_added",
        aggregate_id="a1",
        payload=payload,
    )


# --- routed fields ----------------------------------------------------------------------------


@pytest.mark.parametrize("user_id", [None, ""], ids=["missing", "empty"])
def test_password_reset_needs_the_lookup_field(tableless: Connection, user_id: Any) -> None:
    payload = {"reset_token": "tok_123"} if user_id is None else {**RESET, "user_id": user_id}
    error = _reject(
        tableless,
        InvalidPayloadError,
        "payload.user_id",
        event_type="user.password_reset_requested",
        aggregate_id="user_abc123",
        payload=payload,
    )
    assert "password_reset" in str(error)


def test_password_reset_needs_no_email_field(tableless: Connection) -> None:
    # Its recipient is looked up at send time: no email in the payload is fine, and validation
    # passes (the call only fails on the missing table).
    with pytest.raises(OperationalError):
        publish(
            tableless,
            event_type="user.password_reset_requested",
            aggregate_id="user_abc123",
            payload=RESET,
        )


def test_signed_up_needs_the_dedupe_field(tableless: Connection) -> None:
    error = _reject(
        tableless, InvalidPayloadError, "payload.user_id", **_with_payload(user_id=None)
    )
    assert "user_id" in str(error)
    assert "welcome" in str(error)


def test_unrouted_event_has_no_routed_requirements(tableless: Connection) -> None:
    # cart.viewed: declared in the demo's schemas, routed nowhere.
    with pytest.raises(OperationalError):
        publish(tableless, event_type="cart.viewed", aggregate_id="i1", payload={})


# --- envelope fields --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event_type",
    [
        "UserSignedUp",
        "user",
        "User.signed_up",
        "user..signed_up",
        "user.signed_up.",
        ".user.signed_up",
        "user.signed-up",
        "user signed_up",
        "",
        "a." + "b" * 199,
        None,
        42,
    ],
)
def test_bad_event_type(tableless: Connection, event_type: Any) -> None:
    _reject(tableless, PublishError, "event_type", **_signed_up(event_type=event_type))


@pytest.mark.parametrize("aggregate_id", ["", None, 7, "a" * 201])
def test_bad_aggregate_id(tableless: Connection, aggregate_id: Any) -> None:
    _reject(tableless, PublishError, "aggregate_id", **_signed_up(aggregate_id=aggregate_id))


@pytest.mark.parametrize("priority", ["urgent", "CRITICAL", "", 1])
def test_unknown_priority(tableless: Connection, priority: Any) -> None:
    error = _reject(tableless, UnknownPriorityError, "priority", **_signed_up(priority=priority))
    assert "critical, transactional, bulk" in str(error)


@pytest.mark.parametrize("priority", ["bulk", Lane.CRITICAL])
def test_known_priority_passes_validation(tableless: Connection, priority: Any) -> None:
    with pytest.raises(OperationalError):
        publish(tableless, **_signed_up(priority=priority))


@pytest.mark.parametrize("field", ["occurred_at", "send_after", "expires_at"])
def test_naive_datetimes_are_refused(tableless: Connection, field: str) -> None:
    naive = datetime(2030, 1, 1, 12, 0)
    error = _reject(tableless, PublishError, field, **_signed_up(**{field: naive}))
    assert "timezone" in str(error)


@pytest.mark.parametrize("field", ["occurred_at", "send_after", "expires_at"])
def test_non_datetimes_are_refused(tableless: Connection, field: str) -> None:
    _reject(tableless, PublishError, field, **_signed_up(**{field: "2030-01-01T00:00:00Z"}))


@pytest.mark.parametrize("offset", [timedelta(0), -timedelta(seconds=1)], ids=["equal", "before"])
def test_expires_at_must_be_after_send_after(tableless: Connection, offset: timedelta) -> None:
    send_after = NOW + timedelta(hours=1)
    kwargs = _signed_up(send_after=send_after, expires_at=send_after + offset)
    _reject(tableless, PublishError, "expires_at", **kwargs)


def test_expires_at_in_the_past_without_send_after(tableless: Connection) -> None:
    _reject(tableless, PublishError, "expires_at", **_signed_up(expires_at=NOW - timedelta(1)))


def test_expires_at_compares_instants_across_time_zones(tableless: Connection) -> None:
    # 13:30+02:00 is 11:30Z: before a 12:00Z send_after, though the wall clock says later.
    send_after = datetime(2031, 1, 1, 12, 0, tzinfo=UTC)
    expires_at = datetime(2031, 1, 1, 13, 30, tzinfo=timezone(timedelta(hours=2)))
    kwargs = _signed_up(send_after=send_after, expires_at=expires_at)
    _reject(tableless, PublishError, "expires_at", **kwargs)


@pytest.mark.parametrize("version", [0, -1, True, "2", 1.0])
def test_bad_event_version(tableless: Connection, version: Any) -> None:
    _reject(tableless, PublishError, "event_version", **_signed_up(event_version=version))


# --- transaction discipline -------------------------------------------------------------------


def test_connection_not_in_a_transaction_is_refused(migrated: Engine) -> None:
    with migrated.connect() as connection:
        assert not connection.in_transaction()
        with pytest.raises(NotInTransactionError):
            publish(connection, **_signed_up())
        # publish() did not quietly begin a transaction of its own either.
        assert not connection.in_transaction()
    with migrated.connect() as connection:
        assert connection.execute(select(func.count()).select_from(email_outbox)).scalar() == 0


def test_not_in_transaction_is_not_a_publish_error(migrated: Engine) -> None:
    # A programming error, not bad data: callers catching ValueError must not swallow it.
    with migrated.connect() as connection, pytest.raises(NotInTransactionError) as info:
        publish(connection, **_signed_up())
    assert not isinstance(info.value, ValueError)


def test_validation_error_wins_over_missing_transaction(migrated: Engine) -> None:
    with migrated.connect() as connection, pytest.raises(InvalidAddressError):
        publish(connection, **_with_payload(email="nope"))


# --- regressions: defects found in review, fixed -------------------------------------------


def test_event_type_with_trailing_newline_is_refused() -> None:
    with pytest.raises(PublishError) as info:
        validation.check_event_type("user.signed_up\n")
    assert info.value.field == "event_type"


def test_check_address_refuses_a_trailing_newline() -> None:
    with pytest.raises(PublishError) as info:
        validation.check_address("to", "jane@example.com\n")
    assert info.value.field == "to"
