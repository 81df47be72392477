"""``publish()`` checks the payload against the schema of the event's version, on SQLite and
PostgreSQL: a mismatch names the field and writes nothing, an undeclared type or version is
refused by a table that declares schemas, a table that declares none is as lenient as before."""

import dataclasses

import pytest
from sqlalchemy import Engine, func, select

from email_platform import publish, publish_many
from email_platform.common.errors import (
    ConfigurationError,
    InvalidPayloadError,
    PayloadSchemaError,
    UndeclaredEventError,
)
from email_platform.db.schema import email_outbox
from email_platform.mail.routes import demo_routes
from email_platform.store import outbox


def _count(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(email_outbox)).scalar_one()


RECEIPT = {
    "order_id": "O-1",
    "email": "ada@example.com",
    "first_name": "Ada",
    "items": [{"name": "Mug", "quantity": 2, "unit_price": 9.5}],
    "total": 19.0,
    "currency": "EUR",
}


def test_a_payload_that_matches_its_schema_is_written(engine: Engine) -> None:
    with engine.begin() as connection:
        event_id = publish(connection, event_type="order.paid", aggregate_id="o1", payload=RECEIPT)
        row = outbox.get_event(connection, event_id)
    assert row is not None and row.payload == RECEIPT and row.event_version == 1


@pytest.mark.parametrize(
    ("change", "field", "rule"),
    [
        ({"order_id": None}, "payload.order_id", "type"),
        ({"total": "19.00"}, "payload.total", "type"),
        (
            {"items": [{"name": "Mug", "quantity": 0, "unit_price": 9.5}]},
            "payload.items[0].quantity",
            "minimum",
        ),
    ],
)
def test_a_mismatch_names_the_field_and_writes_nothing(
    engine: Engine, change: dict, field: str, rule: str
) -> None:
    with pytest.raises(PayloadSchemaError) as raised, engine.begin() as connection:
        publish(
            connection, event_type="order.paid", aggregate_id="o1", payload={**RECEIPT, **change}
        )
    error = raised.value
    assert isinstance(error, InvalidPayloadError)  # callers that catch the broader class still do
    assert (error.field, error.rule, error.event_type, error.event_version) == (
        field, rule, "order.paid", 1,
    )  # fmt: skip
    assert str(error).startswith(f"{field}: ")
    assert _count(engine) == 0


def test_a_missing_required_field_is_named_itself(engine: Engine) -> None:
    payload = {k: v for k, v in RECEIPT.items() if k != "order_id"}
    with pytest.raises(PayloadSchemaError) as raised, engine.begin() as connection:
        publish(connection, event_type="order.paid", aggregate_id="o1", payload=payload)
    assert raised.value.field == "payload.order_id"
    assert "is required" in str(raised.value)


def test_an_undeclared_version_or_type_is_refused(engine: Engine) -> None:
    signup = {"user_id": "u1", "email": "ada@example.com", "first_name": "Ada"}
    with pytest.raises(UndeclaredEventError) as raised, engine.begin() as connection:
        publish(
            connection,
            event_type="user.signed_up",
            event_version=3,
            aggregate_id="u1",
            payload=signup,
        )
    assert raised.value.field == "event_version"
    assert raised.value.declared_versions == (1, 2)
    with pytest.raises(UndeclaredEventError) as raised, engine.begin() as connection:
        publish(connection, event_type="billing.invoice_voided", aggregate_id="i1", payload={})
    assert raised.value.field == "event_type"
    assert _count(engine) == 0


def test_a_table_without_schemas_is_as_lenient_as_before(engine: Engine) -> None:
    lenient = dataclasses.replace(demo_routes(), schemas={})
    with engine.begin() as connection:
        publish(
            connection,
            event_type="billing.invoice_voided",
            aggregate_id="i1",
            payload={},
            routes=lenient,
        )
        publish(
            connection,
            event_type="order.paid",
            aggregate_id="o1",
            payload={"email": "a@example.com", "total": "any"},
            routes=lenient,
        )
    assert _count(engine) == 2


def test_a_v1_payload_is_checked_against_v1_and_its_upcast_against_v2(engine: Engine) -> None:
    v1 = {"user_id": "u1", "email": "ada@example.com", "name": "Ada Lovelace"}
    with engine.begin() as connection:
        publish(
            connection, event_type="user.signed_up", event_version=1, aggregate_id="u1", payload=v1
        )
    with pytest.raises(PayloadSchemaError) as raised, engine.begin() as connection:
        publish(
            connection,
            event_type="user.signed_up",
            event_version=1,
            aggregate_id="u2",
            payload={**v1, "user_id": "u2", "name": 7},
        )
    assert (raised.value.field, raised.value.event_version) == ("payload.name", 1)
    # An upcaster that makes what v2 refuses: on its examples, the table fails its check ...
    broken = demo_routes()
    broken.upcasters[("user.signed_up", 1)] = lambda p: {**p, "first_name": 1}
    with pytest.raises(ConfigurationError, match="first_name"), engine.begin() as connection:
        publish(
            connection, event_type="order.paid", aggregate_id="o1", payload=RECEIPT, routes=broken
        )
    # ... and on a payload its examples missed, publish() names the field and the upcast.
    edge = demo_routes()
    edge.upcasters[("user.signed_up", 1)] = lambda p: {**p, "first_name": p["name"] or 0}
    with pytest.raises(PayloadSchemaError) as raised, engine.begin() as connection:
        publish(
            connection,
            event_type="user.signed_up",
            event_version=1,
            aggregate_id="u3",
            payload={**v1, "user_id": "u3", "name": ""},
            routes=edge,
        )
    assert (raised.value.field, raised.value.event_version) == ("payload.first_name", 2)
    assert "upcast from v1" in str(raised.value)
    assert _count(engine) == 1


def test_publish_many_names_the_event_and_the_field_and_writes_nothing(engine: Engine) -> None:
    good = {"event_type": "order.paid", "aggregate_id": "o1", "payload": RECEIPT}
    bad = {**good, "payload": {**RECEIPT, "currency": "euros"}}
    with pytest.raises(PayloadSchemaError) as raised, engine.begin() as connection:
        publish_many(connection, [good, good, bad])
    assert raised.value.field == "events[2].payload.currency"
    assert raised.value.rule == "pattern" and raised.value.event_type == "order.paid"
    assert _count(engine) == 0


def test_every_event_the_demo_and_the_bench_publish_matches_its_schema(engine: Engine) -> None:
    """The demo's own producer (v1 and v2 signups, resets, receipts, digests, an unrouted
    cart.viewed) and the bench's backlog publish through the demo's strict table unchanged."""
    from bench.workload import publish_backlog
    from email_platform.local.demo import publish_demo_events

    ids = publish_demo_events(engine, "s", signups=12, resets=3, receipts=3, digests=4)
    publish_backlog(engine, 5)
    assert _count(engine) == len(ids) + 5
    with engine.connect() as connection:
        versions = connection.execute(
            select(email_outbox.c.event_type, email_outbox.c.event_version).distinct()
        ).all()
    assert ("user.signed_up", 1) in versions and ("cart.viewed", 1) in versions
