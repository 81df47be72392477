"""Hostile input to ``publish()`` and ``publish_many()``: generated values for every argument.

The invariant: whatever a producer passes, the call either accepts it - returns a 26-character
event id and the outbox row holds exactly what was passed (the JSON of the payload and metadata,
the same instants for the timestamps, ``available_at`` equal to ``send_after``) - or raises a
``PublishError`` (or a subclass) whose ``.field`` names the argument at fault (``payload...``,
``metadata...``, ``events[3]...``). Never another exception, never a database error, and the
caller's transaction is still usable afterwards: a ``SELECT 1`` and a second, valid ``publish``
on the same connection succeed and commit. A ``publish_many`` with one bad event among good ones
writes nothing.

Hostile means: arbitrary text (NUL, lone surrogates, CR/LF, U+2028, RFC 2047 encoded words
that decode to line breaks, strings either side of the column limits 26/200/255/320), integers
far outside int32/int64, bools, floats with nan/inf, None, bytes, dicts and lists nested 30 to
2000 deep, non-string dict keys, naive datetimes, aware ones with odd offsets, extreme years
and broken tzinfos, and the wrong type for every field. Every example runs on SQLite and on
PostgreSQL (the ``engine`` fixture), each inside ``with engine.begin() as connection:``.

Also a differential property of the address fast path: whatever ASCII address
``validation._plainly_valid`` accepts, ``email-validator`` (as ``check_address`` calls it)
accepts too.

Encoded words in charsets whose codecs refuse ``errors="replace"`` (``idna``, ``punycode``)
and a ``priority`` whose hash raises were defects these properties found; they are in the
examples like everything else.
"""

import json
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from types import MappingProxyType
from typing import Any

import pytest
from email_validator import EmailNotValidError, validate_email
from hypothesis import event, given
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.orm import Session

from email_platform import PublishError, publish, publish_many
from email_platform.common.errors import NotInTransactionError, UndeclaredEventError
from email_platform.common.ids import is_ulid
from email_platform.common.lanes import Lane
from email_platform.common.timeutil import as_utc
from email_platform.db.schema import email_outbox
from email_platform.mail.routes import RouteTable, default_routes
from email_platform.publishing import validation
from email_platform.publishing.validation import MAX_ADDRESS_LENGTH, _plainly_valid
from email_platform.store import outbox
from tests.hostile_support import (
    LENGTHS,
    SPECIAL_TEXT,
    hostile_datetimes,
    hostile_settings,
    hostile_text,
    hostile_values,
    huge_integers,
    odd_floats,
    odd_keys,
)

ROUTES = default_routes()
ARGUMENTS = (
    "event_type",
    "aggregate_id",
    "payload",
    "event_version",
    "occurred_at",
    "send_after",
    "expires_at",
    "idempotency_key",
    "priority",
    "metadata",
)
#: An error may name an argument that was not made hostile only when a hostile one changed
#: what it must hold: another event type or version reads other payload fields, and
#: ``expires_at`` must be later than ``send_after``.
DEPENDS_ON = {
    "payload": {"event_type", "event_version"},
    "expires_at": {"send_after"},
}

VALID_PAYLOADS: dict[str, dict[str, Any]] = {
    "user.signed_up": {"user_id": "user_1", "email": "jane@example.com", "first_name": "Jane"},
    "user.password_reset_requested": {"user_id": "user_1", "reset_token": "tok_1"},
    "order.paid": {"email": "buyer@example.com", "first_name": "Bo", "order_id": "o_1"},
    "digest.ready": {"email": "reader@example.com", "first_name": "Al", "highlights": ["a"]},
    # unrouted, and declared in the demo's schemas with no required field
    "cart.viewed": {"cart_id": "c1"},
}
UNROUTED = ("cart.viewed",)
#: The follow-up event every example publishes on the same connection.
FOLLOW_UP = {
    "event_type": "order.paid",
    "aggregate_id": "order_follow_up",
    "payload": {"email": "after@example.com", "first_name": "After", "order_id": "o_2"},
}

# ---- strategies ----------------------------------------------------------------------------

hostile_addresses = st.one_of(
    hostile_text,
    st.builds(
        lambda local, sep, domain: f"{local}{sep}{domain}",
        st.one_of(st.sampled_from(["jane", "a" * 64, "a" * 65, "j.d", ".j", "j..d"]), hostile_text),
        st.sampled_from(["@", "@@", "", " @"]),
        st.one_of(
            st.sampled_from(
                [
                    "example.com",
                    "exämple.com",
                    "xn--bcher-kva.example",
                    "localhost",
                    "example.test",
                    "[127.0.0.1]",
                    "127.0.0.1",
                    "-x.com",
                    "x-.com",
                    "a--b.com",
                    "example.c0m",
                    ("a" * 63 + ".") * 4 + "com",
                ]
            ),
            hostile_text,
        ),
    ),
    st.builds(lambda s: f"jane{s}@example.com", st.sampled_from(SPECIAL_TEXT)),
    st.builds(lambda s: f"jane@example.com{s}", st.sampled_from(SPECIAL_TEXT)),
)

event_types = st.one_of(
    st.sampled_from(sorted(VALID_PAYLOADS)),
    st.sampled_from(
        [
            "User.signed_up",
            "user.signed_up ",
            "user.signed_up\n",
            "user..signed_up",
            "user",
            ".user",
            "user.",
            "1user.x",
            "user.sign-up",
            "user.signed_up\x00",
            "ü.x",
            "a." + "b" * 198,  # 200 characters: fits
            "a." + "b" * 199,  # 201: does not
        ]
    ),
    hostile_text,
    hostile_values,
)

versions = st.one_of(
    st.sampled_from([None, 0, 1, 2, 3, -1, 2**31 - 1, 2**31, 2**63, True, False, 2.0, "2"]),
    huge_integers,
    odd_floats,
    hostile_values,
)

priorities = st.one_of(
    st.sampled_from([None, "critical", "transactional", "bulk", *list(Lane)]),
    st.sampled_from(["CRITICAL", " bulk", "bulk\n", "urgent", "", 0, 1, True, ["bulk"]]),
    hostile_text,
    hostile_values,
)

timestamps = st.one_of(
    st.none(),
    hostile_datetimes,
    st.sampled_from(
        [
            date(2030, 1, 1),
            "2030-01-01T00:00:00Z",
            1893456000,
            1893456000.5,
            timedelta(days=1),
        ]
    ),
    hostile_values,
)

texts = st.one_of(hostile_text, hostile_values, st.sampled_from([None, "id_1"]))

#: A value for one payload field of a routed event.
field_values = st.one_of(hostile_text, hostile_addresses, hostile_values)


@st.composite
def payloads(draw: st.DrawFn, event_type: Any) -> Any:
    """A hostile payload: not a mapping, or a valid one with fields replaced, removed, added."""
    known = isinstance(event_type, str) and event_type in VALID_PAYLOADS
    base = dict(VALID_PAYLOADS[event_type]) if known else {"anything": 1}
    how = draw(st.sampled_from(["whole", "fields", "fields", "remove", "extra", "v1", "mapping"]))
    if how == "whole":
        return draw(hostile_values)
    if how == "remove" and base:
        base.pop(draw(st.sampled_from(sorted(base))))
        return base
    if how == "extra":
        key = draw(st.one_of(odd_keys, hostile_text))
        base[key] = draw(hostile_values)
        return base
    if how == "v1":  # user.signed_up v1 carries "name", upcast to first_name
        base.pop("first_name", None)
        base["name"] = draw(st.one_of(hostile_text, hostile_values))
        return base
    if how == "mapping":  # a Mapping that is not a dict
        return MappingProxyType(base)
    names = draw(
        st.lists(
            st.sampled_from([*sorted(base), "email", "first_name", "user_id", "order_id"]),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    for name in names:
        base[name] = draw(hostile_addresses if name == "email" else field_values)
    return base


VALID_OPTIONAL = {
    # Years 1 and 9999 are refused: a reader in another time zone could not read them back.
    "occurred_at": st.datetimes(
        min_value=datetime(2, 1, 2), max_value=datetime(9998, 12, 30), timezones=st.just(UTC)
    ),
    "send_after": st.datetimes(
        min_value=datetime(2030, 1, 1), max_value=datetime(2031, 1, 1), timezones=st.just(UTC)
    ),
    "expires_at": st.datetimes(
        min_value=datetime(2032, 1, 1), max_value=datetime(2033, 1, 1), timezones=st.just(UTC)
    ),
    "idempotency_key": st.text(
        alphabet=string.ascii_letters + string.digits + "_-:", min_size=1, max_size=200
    ),
    "priority": st.sampled_from(["critical", "transactional", "bulk"]),
    "metadata": st.dictionaries(
        st.text(string.ascii_lowercase, min_size=1, max_size=8),
        st.text(string.ascii_letters, max_size=20),
        max_size=3,
    ),
    "event_version": st.none(),
}


@st.composite
def publish_kwargs(draw: st.DrawFn) -> tuple[dict[str, Any], set[str]]:
    """``publish()`` keyword arguments with one to three of them hostile, and which ones."""
    event_type = draw(st.sampled_from(sorted(VALID_PAYLOADS)))
    kwargs: dict[str, Any] = {
        "event_type": event_type,
        "aggregate_id": "agg_1",
        "payload": dict(VALID_PAYLOADS[event_type]),
    }
    for name in draw(st.lists(st.sampled_from(sorted(VALID_OPTIONAL)), max_size=3, unique=True)):
        kwargs[name] = draw(VALID_OPTIONAL[name])
    hostile = set(draw(st.lists(st.sampled_from(ARGUMENTS), min_size=1, max_size=3, unique=True)))
    if "event_type" in hostile:
        kwargs["event_type"] = draw(event_types)
    strategies: dict[str, st.SearchStrategy[Any]] = {
        "aggregate_id": texts,
        "payload": payloads(kwargs["event_type"]),
        "event_version": versions,
        "occurred_at": timestamps,
        "send_after": timestamps,
        "expires_at": timestamps,
        "idempotency_key": texts,
        "priority": priorities,
        "metadata": st.one_of(
            hostile_values,
            st.dictionaries(st.one_of(hostile_text, odd_keys), hostile_values, max_size=3),
            st.dictionaries(st.sampled_from(["producer", "trace_id"]), hostile_text, max_size=2),
        ),
    }
    for name in sorted(hostile - {"event_type"}):
        kwargs[name] = draw(strategies[name])
    return kwargs, hostile


# ---- checks --------------------------------------------------------------------------------


def _count(connection: Connection) -> int:
    return connection.execute(select(func.count()).select_from(email_outbox)).scalar_one()


def _instant(value: datetime) -> datetime:
    # astimezone on both sides: comparing across zones treats fold-dependent times as unequal.
    return value.astimezone(UTC)


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def first_with_key(connection: Connection, kwargs: Any) -> str | None:
    """The event already published with ``kwargs``' idempotency key: publish() returns it."""
    key = _valid_key(kwargs)
    return None if key is None else outbox.first_events_with_keys(connection, [key]).get(key)


def _valid_key(kwargs: Any) -> str | None:
    """The idempotency key publish() would accept, if ``kwargs`` has one."""
    key = kwargs.get("idempotency_key") if isinstance(kwargs, Mapping) else None
    try:
        return validation.check_idempotency_key(key) if key is not None else None
    except PublishError:
        return None


def expected_ids(connection: Connection, events: Any) -> list[str | None]:
    """Per event of a publish_many() call, the id it must get if its key was published
    already (in the outbox or earlier in the batch: index of that event as ``"#i"``)."""
    seen: dict[str, str] = {}
    expected: list[str | None] = []
    for index, kwargs in enumerate(events):
        prior = first_with_key(connection, kwargs)
        key = _valid_key(kwargs)
        expected.append(prior or seen.get(key))
        if key and prior is None and key not in seen:
            seen[key] = f"#{index}"
    return expected


def assert_published_once_per_key(
    connection: Connection,
    events: Sequence[Mapping],
    event_ids: list[str],
    expected: list[str | None],
    before: int,
) -> None:
    """Each event is stored as passed, or got the id of the first event with its key."""
    assert len(event_ids) == len(events) == len(expected)
    for event_id, kwargs, prior in zip(event_ids, events, expected, strict=True):
        if prior is None:
            assert_stored_as_passed(connection, event_id, kwargs)
        elif prior.startswith("#"):
            assert event_id == event_ids[int(prior[1:])]
        else:
            assert event_id == prior
    new = [event_id for event_id, prior in zip(event_ids, expected, strict=True) if prior is None]
    assert len(set(new)) == len(new) and _count(connection) == before + len(new)


def assert_stored_as_passed(connection: Connection, event_id: str, kwargs: Mapping) -> None:
    """The row of an accepted event holds what the producer passed."""
    assert isinstance(event_id, str) and len(event_id) == 26 and is_ulid(event_id)
    row = outbox.get_event(connection, event_id)
    assert row is not None
    event_type = kwargs["event_type"]
    version = kwargs.get("event_version")
    assert row.event_type == event_type
    expected_version = ROUTES.default_version(event_type) if version is None else version
    assert row.event_version == expected_version
    assert row.aggregate_id == kwargs["aggregate_id"]
    assert row.payload == _json(kwargs["payload"])
    assert row.event_metadata == (_json(dict(kwargs["metadata"])) if kwargs.get("metadata") else {})
    priority = kwargs.get("priority")
    lane = Lane(priority) if priority is not None else ROUTES.lane_for(event_type)
    assert row.lane == (lane or Lane.TRANSACTIONAL).value
    assert row.idempotency_key == kwargs.get("idempotency_key")
    assert row.status == "pending"
    published_at = as_utc(row.published_at)
    if kwargs.get("occurred_at") is not None:
        assert as_utc(row.occurred_at) == _instant(kwargs["occurred_at"])
    else:
        assert as_utc(row.occurred_at) == published_at
    if kwargs.get("send_after") is not None:
        assert as_utc(row.available_at) == _instant(kwargs["send_after"])
    else:
        assert as_utc(row.available_at) == published_at
    if kwargs.get("expires_at") is not None:
        assert as_utc(row.expires_at) == _instant(kwargs["expires_at"])
        assert as_utc(row.expires_at) > as_utc(row.available_at)
    else:
        assert row.expires_at is None


def assert_names_a_hostile_argument(
    error: PublishError, hostile: set[str], prefix: str = ""
) -> str:
    """``error`` names (after ``prefix``) an argument that was hostile, or one it depends on."""
    assert isinstance(error, ValueError)
    assert str(error).startswith(f"{error.field}: "), str(error)
    assert error.field.startswith(prefix), (error.field, prefix)
    field = error.field[len(prefix) :]
    if isinstance(error, UndeclaredEventError):
        # The demo's table declares schemas: a type or version it does not declare is refused.
        assert field in ("event_type", "event_version"), error.field
        return field
    root = re.match(r"[a-z_]+", field)
    assert root is not None, error.field
    name = root.group()
    assert name in ARGUMENTS, error.field
    assert name in hostile or DEPENDS_ON.get(name, set()) & hostile, (error.field, hostile)
    return name


def assert_transaction_usable(connection: Connection, before: int) -> str:
    """A statement and a valid publish still work on the connection after the call."""
    assert connection.execute(text("SELECT 1")).scalar_one() == 1
    follow_up = publish(connection, **FOLLOW_UP)
    assert _count(connection) == before + 1
    return follow_up


def assert_committed(engine: Engine, *event_ids: str) -> None:
    with engine.connect() as connection:
        for event_id in event_ids:
            assert outbox.get_event(connection, event_id) is not None, event_id


def _kind(value: Any) -> str:
    return type(value).__name__


# ---- publish() -----------------------------------------------------------------------------


@hostile_settings(max_examples=150)
@given(case=publish_kwargs())
def test_publish_accepts_or_names_the_hostile_argument(engine: Engine, case: Any) -> None:
    kwargs, hostile = case
    with engine.begin() as connection:
        before = _count(connection)
        prior = first_with_key(connection, kwargs)
        try:
            event_id = publish(connection, **kwargs)
        except PublishError as error:
            name = assert_names_a_hostile_argument(error, hostile)
            event(f"refused: {name} ({type(error).__name__})")
            assert _count(connection) == before
            accepted: tuple[str, ...] = ()
        else:
            if prior is not None:  # one event per idempotency key: the first one's id
                event("accepted: key published before")
                assert event_id == prior and _count(connection) == before
            else:
                event("accepted")
                assert_stored_as_passed(connection, event_id, kwargs)
                assert _count(connection) == before + 1
                before += 1
            accepted = (event_id,)
        follow_up = assert_transaction_usable(connection, before)
    assert_committed(engine, *accepted, follow_up)


@hostile_settings(max_examples=100)
@given(
    value=st.one_of(hostile_values, hostile_text, hostile_addresses),
    name=st.sampled_from(ARGUMENTS),
    event_type=st.sampled_from(sorted(VALID_PAYLOADS)),
)
def test_any_value_in_any_single_argument(
    engine: Engine, value: Any, name: str, event_type: str
) -> None:
    """The same property with only one argument off, so each error is that argument's."""
    kwargs: dict[str, Any] = {
        "event_type": event_type,
        "aggregate_id": "agg_1",
        "payload": dict(VALID_PAYLOADS[event_type]),
        name: value,
    }
    with engine.begin() as connection:
        before = _count(connection)
        try:
            event_id = publish(connection, **kwargs)
        except PublishError as error:
            assert_names_a_hostile_argument(error, {name})
            event(f"refused: {name}")
            assert _count(connection) == before
            accepted: tuple[str, ...] = ()
        else:
            event(f"accepted: {name} = {_kind(value)}")
            assert_stored_as_passed(connection, event_id, kwargs)
            before += 1
            accepted = (event_id,)
        follow_up = assert_transaction_usable(connection, before)
    assert_committed(engine, *accepted, follow_up)


@hostile_settings(max_examples=100)
@given(
    field=st.sampled_from(["email", "first_name", "user_id", "order_id", "name", "highlights"]),
    value=st.one_of(hostile_addresses, hostile_text, hostile_values),
    event_type=st.sampled_from(
        ["user.signed_up", "user.password_reset_requested", "order.paid", "digest.ready"]
    ),
    version=st.sampled_from([None, 1]),
)
def test_any_value_in_a_routed_payload_field(
    engine: Engine, field: str, value: Any, event_type: str, version: int | None
) -> None:
    """Recipient, header, lookup and dedupe fields of the shipped routes, v1 upcasts included."""
    payload = {**VALID_PAYLOADS[event_type], field: value}
    kwargs: dict[str, Any] = {"event_type": event_type, "aggregate_id": "agg_1", "payload": payload}
    if version is not None and event_type == "user.signed_up":
        kwargs["event_version"] = version
    with engine.begin() as connection:
        before = _count(connection)
        try:
            event_id = publish(connection, **kwargs)
        except PublishError as error:
            assert_names_a_hostile_argument(error, {"payload"})
            assert error.field.startswith("payload"), error.field
            event(f"refused: {error.field.split(' ')[0][:40]}")
            accepted: tuple[str, ...] = ()
        else:
            event("accepted")
            assert_stored_as_passed(connection, event_id, kwargs)
            before += 1
            accepted = (event_id,)
        follow_up = assert_transaction_usable(connection, before)
    assert_committed(engine, *accepted, follow_up)


@hostile_settings(max_examples=60)
@given(
    when=st.sampled_from(["occurred_at", "send_after", "expires_at"]),
    value=hostile_datetimes,
    send_after=st.one_of(st.none(), hostile_datetimes),
)
def test_any_datetime_is_stored_as_the_same_instant_or_refused(
    engine: Engine, when: str, value: datetime, send_after: datetime | None
) -> None:
    kwargs: dict[str, Any] = {**FOLLOW_UP, "aggregate_id": "agg_1", when: value}
    hostile = {when}
    if when == "expires_at" and send_after is not None:
        kwargs["send_after"] = send_after
        hostile.add("send_after")
    with engine.begin() as connection:
        before = _count(connection)
        try:
            event_id = publish(connection, **kwargs)
        except PublishError as error:
            event(f"refused: {assert_names_a_hostile_argument(error, hostile)}")
            accepted: tuple[str, ...] = ()
        else:
            event("accepted")
            assert_stored_as_passed(connection, event_id, kwargs)
            before += 1
            accepted = (event_id,)
        follow_up = assert_transaction_usable(connection, before)
    assert_committed(engine, *accepted, follow_up)


# ---- the arguments that are not fields -----------------------------------------------------


@hostile_settings(max_examples=60)
@given(connection_value=st.one_of(hostile_values, st.sampled_from(["engine", "closed"])))
def test_something_that_is_not_a_connection_writes_nothing(
    engine: Engine, connection_value: Any
) -> None:
    """Not a Connection or Session: ``TypeError``; a closed one: ``NotInTransactionError``."""
    if connection_value == "engine":
        connection_value = engine
    if connection_value == "closed":
        closed = engine.connect()
        closed.close()
        connection_value = closed
    with engine.connect() as connection:
        before = _count(connection)
    with pytest.raises((TypeError, NotInTransactionError)):
        publish(connection_value, **FOLLOW_UP)
    with engine.connect() as connection:
        assert _count(connection) == before


@hostile_settings(max_examples=60)
@given(
    case=publish_kwargs(), routes=st.sampled_from([None, "empty", "shipped"]), session=st.booleans()
)
def test_routes_and_sessions(engine: Engine, case: Any, routes: str | None, session: bool) -> None:
    """The same property with a RouteTable of the caller's (none routed) or a Session."""
    kwargs, hostile = case
    table = {None: None, "empty": RouteTable(), "shipped": default_routes()}[routes]
    with Session(engine) as db:
        target: Connection | Session = db if session else db.connection()
        prior = first_with_key(db.connection(), kwargs)
        try:
            event_id = publish(target, routes=table, **kwargs)
        except PublishError as error:
            assert_names_a_hostile_argument(error, hostile)
            accepted: tuple[str, ...] = ()
        else:
            if prior is not None:
                assert event_id == prior
            elif table is None or table.routes:
                assert_stored_as_passed(db.connection(), event_id, kwargs)
            accepted = (event_id,)
        assert db.execute(text("SELECT 1")).scalar_one() == 1
        follow_up = publish(target, **FOLLOW_UP)
        db.commit()
    assert_committed(engine, *accepted, follow_up)


# ---- publish_many() ------------------------------------------------------------------------


@st.composite
def valid_events(draw: st.DrawFn) -> dict[str, Any]:
    event_type = draw(st.sampled_from(sorted(VALID_PAYLOADS)))
    kwargs: dict[str, Any] = {
        "event_type": event_type,
        "aggregate_id": draw(st.text(string.ascii_letters, min_size=1, max_size=20)),
        "payload": dict(VALID_PAYLOADS[event_type]),
    }
    for name in draw(st.lists(st.sampled_from(sorted(VALID_OPTIONAL)), max_size=2, unique=True)):
        kwargs[name] = draw(VALID_OPTIONAL[name])
    return kwargs


@st.composite
def bad_events(draw: st.DrawFn) -> tuple[Any, set[str] | None]:
    """One hostile item for ``publish_many``: hostile arguments (and which), or not even a
    mapping of publish() arguments (``None``: any error must name the item itself)."""
    how = draw(st.sampled_from(["arguments", "arguments", "arguments", "keys", "item"]))
    if how == "arguments":
        return draw(publish_kwargs())
    if how == "keys":
        kwargs = draw(valid_events())
        choice = draw(
            st.sampled_from(["unknown", "missing", "odd key", "routes", "now", "connection"])
        )
        if choice == "missing":
            kwargs.pop(draw(st.sampled_from(["event_type", "aggregate_id", "payload"])))
        elif choice == "odd key":
            kwargs[draw(odd_keys.filter(lambda k: not isinstance(k, str)))] = 1
        else:
            kwargs[{"unknown": "evnt_type"}.get(choice, choice)] = draw(hostile_values)
        return kwargs, None
    return draw(st.one_of(hostile_values, hostile_text).filter(_not_mapping)), None


def _not_mapping(value: Any) -> bool:
    return not isinstance(value, Mapping)


@hostile_settings(max_examples=120)
@given(
    good=st.lists(valid_events(), min_size=1, max_size=6),
    bad=bad_events(),
    position=st.integers(min_value=0, max_value=6),
)
def test_publish_many_with_one_bad_event_writes_all_or_nothing(
    engine: Engine, good: list[dict[str, Any]], bad: Any, position: int
) -> None:
    item, hostile = bad
    index = min(position, len(good))
    events = [*good[:index], item, *good[index:]]
    with engine.begin() as connection:
        before = _count(connection)
        expected = expected_ids(connection, events) if hostile is not None else []
        try:
            event_ids = publish_many(connection, events)
        except PublishError as error:
            if hostile is None:
                assert error.field.startswith(f"events[{index}]"), error.field
                assert str(error).startswith(f"{error.field}: ")
            else:
                assert_names_a_hostile_argument(error, hostile, prefix=f"events[{index}].")
            event(f"refused: {error.field.split('.')[0]} ({type(error).__name__})")
            assert _count(connection) == before  # nothing written, not even the good ones
            accepted: list[str] = []
        else:
            event("accepted")
            assert_published_once_per_key(connection, events, event_ids, expected, before)
            before += sum(1 for e in expected if e is None)
            accepted = event_ids
        follow_up = assert_transaction_usable(connection, before)
    assert_committed(engine, *accepted, follow_up)


class _OneShot:
    """An iterator over ``events`` that, like a generator, can be read once; the test keeps
    the list to know what was published."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self._items = iter(events)

    def __iter__(self) -> "_OneShot":
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._items)


def _generated(events: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return _OneShot(events)


@hostile_settings(max_examples=80)
@given(
    events=st.one_of(
        hostile_values,
        hostile_text,
        st.binary(max_size=10),
        st.lists(valid_events(), max_size=3).map(tuple),
        st.lists(valid_events(), max_size=3).map(_generated),
        st.lists(valid_events(), max_size=3).map(lambda e: {"events": e}),
        st.lists(st.lists(st.tuples(st.text(max_size=3), st.integers())), max_size=2),
    )
)
def test_publish_many_with_anything_for_events(engine: Engine, events: Any) -> None:
    """Not a list of mappings: refused as ``events`` or ``events[i]``; an iterable of valid
    events (a tuple, a generator) is accepted."""
    with engine.begin() as connection:
        before = _count(connection)
        items = (
            list(events.events if isinstance(events, _OneShot) else events)
            if isinstance(events, _OneShot | list | tuple)
            else []
        )
        mappings = all(isinstance(item, Mapping) for item in items)
        expected = expected_ids(connection, items) if mappings else []
        try:
            event_ids = publish_many(connection, events)
        except PublishError as error:
            assert re.fullmatch(r"events(\[\d+\](\..*)?)?", error.field), error.field
            event(f"refused: {re.sub(r'[0-9]+', 'i', error.field.split('.')[0])}")
            assert _count(connection) == before
            accepted: list[str] = []
        else:
            event(f"accepted: {len(event_ids)} events")
            assert_published_once_per_key(connection, items, event_ids, expected, before)
            before += sum(1 for e in expected if e is None)
            accepted = event_ids
        follow_up = assert_transaction_usable(connection, before)
    assert_committed(engine, *accepted, follow_up)


# ---- the address fast path against email-validator -----------------------------------------

ATEXT = string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-"
_local = st.one_of(
    st.lists(st.text(ATEXT, min_size=1, max_size=66), min_size=1, max_size=3).map(".".join),
    st.text(string.printable, max_size=70),
)
_label = st.one_of(
    st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=64),
    st.sampled_from(["xn--bcher-kva", "xn--p1ai", "xn--", "a--b", "-a", "a-", "0", "00"]),
)
_tld = st.one_of(
    st.sampled_from(
        [
            "com",
            "COM",
            "io",
            "museum",
            "test",
            "local",
            "localhost",
            "onion",
            "arpa",
            "invalid",
            "example",
            "internal",
            "home",
            "lan",
            "corp",
            "xn--p1ai",
            "c0m",
            "a",
            "aa",
        ]
    ),
    st.text(string.ascii_letters, min_size=1, max_size=64),
)
ascii_addresses = st.one_of(
    st.builds(
        lambda local, labels, tld: f"{local}@{'.'.join([*labels, tld])}",
        _local,
        st.lists(_label, min_size=1, max_size=5),
        _tld,
    ),
    st.builds(
        lambda n, m: (
            "a" * n + "@" + ".".join(["b" * 63] * (m // 64) + ["c" * (m % 64 or 1)]) + ".com"
        ),
        st.sampled_from(LENGTHS),
        st.integers(min_value=1, max_value=260),
    ),
    st.text(string.printable, max_size=80),
)


@hostile_settings(max_examples=150)
@given(address=ascii_addresses)
def test_the_address_fast_path_accepts_only_what_email_validator_accepts(address: str) -> None:
    """``check_address`` applies ``_plainly_valid`` to what is at most 254 characters."""
    if len(address) > MAX_ADDRESS_LENGTH:
        event("longer than an address may be")
        return
    if not _plainly_valid(address):
        event("not plainly valid")
        return
    event("plainly valid")
    try:
        validate_email(
            address,
            check_deliverability=False,
            allow_smtputf8=False,
            allow_quoted_local=False,
            allow_domain_literal=False,
            strict=True,
        )
    except EmailNotValidError as exc:
        raise AssertionError(f"{address!r} is plainly valid; email-validator: {exc}") from None
