"""``email_platform.testing``, used as a product's tests use it: assert which events a request
published (committed ones only, as the worker sees them) and render a route's mail for a payload
without sending it."""

import dataclasses
from pathlib import Path

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, create_engine

from email_platform import publish, publish_many
from email_platform.common.errors import TemplateRenderError
from email_platform.common.lanes import Lane
from email_platform.mail.routes import Route, RouteTable, demo_routes
from email_platform.testing import (
    create_tables,
    published_events,
    recording_published,
    render,
)

product = MetaData()
accounts = Table(
    "accounts",
    product,
    Column("id", Integer, primary_key=True),
    Column("email", String(200), nullable=False),
)


def sign_up(engine: Engine, user_id: str, email: str, *, fail: bool = False) -> None:
    """The product's request handler: its business row and the event, in one transaction."""
    with engine.begin() as connection:
        connection.execute(accounts.insert().values(email=email))
        publish(
            connection,
            event_type="user.signed_up",
            aggregate_id=user_id,
            payload={"user_id": user_id, "email": email, "first_name": "Jo"},
            correlation_id="req-1",
        )
        if fail:
            raise RuntimeError("the request failed after publishing")


def test_a_recording_holds_what_the_block_committed_in_order(engine: Engine) -> None:
    product.create_all(engine)
    sign_up(engine, "u0", "before@example.com")  # published before: not recorded
    with recording_published(engine) as published:
        sign_up(engine, "u1", "jo@example.com")
        with pytest.raises(RuntimeError):
            sign_up(engine, "u2", "rolled-back@example.com", fail=True)
        with engine.begin() as connection:
            publish_many(
                connection,
                [
                    {
                        "event_type": "order.paid",
                        "aggregate_id": "o1",
                        "payload": {"email": "jo@example.com", "first_name": "Jo", "order_id": 7},
                    },
                    {
                        "event_type": "digest.ready",
                        "aggregate_id": "u1",
                        "payload": {"email": "jo@example.com", "first_name": "Jo"},
                    },
                ],
            )
    # One publish_many's events share an instant: in no particular order among themselves.
    assert published.event_types[0] == "user.signed_up"
    assert sorted(published.event_types[1:]) == ["digest.ready", "order.paid"]
    signup = published.of_type("user.signed_up")[0]
    assert signup.aggregate_id == "u1"
    assert signup.payload == {"user_id": "u1", "email": "jo@example.com", "first_name": "Jo"}
    assert signup.event_version == 2 and signup.lane == "transactional"
    assert signup.correlation_id == "req-1" and signup.status == "pending"
    assert {e.event_type: e.lane for e in published.events} == {
        "user.signed_up": "transactional",
        "order.paid": "transactional",
        "digest.ready": "bulk",
    }
    # The plain read, filtered.
    assert [e.aggregate_id for e in published_events(engine, event_type="user.signed_up")] == [
        "u0",
        "u1",
    ]
    assert [e.event_type for e in published_events(engine, aggregate_id="u1")] == [
        "user.signed_up",
        "digest.ready",
    ]
    with engine.connect() as connection:
        assert len(published_events(connection)) == 4


def test_create_tables_gives_a_fresh_database_what_publish_needs(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'product.sqlite3'}")
    create_tables(engine)
    create_tables(engine)  # again: nothing to do
    product.create_all(engine)
    with recording_published(engine) as published:
        sign_up(engine, "u1", "jo@example.com")
    assert [e.aggregate_id for e in published.events] == ["u1"]


def test_render_gives_a_routes_mail_as_the_send_path_renders_it() -> None:
    payload = {"user_id": "u1", "email": "jo@example.com", "first_name": "Jo"}
    mail = render("welcome", payload)
    assert mail.subject == "Welcome to Example, Jo!"
    assert "Jo" in mail.text and mail.html is not None and "Jo" in mail.html
    assert mail.template == "welcome" and mail.template_version == 1
    # A route object, and an older event version upcast first as the worker does.
    welcome = demo_routes().route("welcome")
    assert render(welcome, payload).subject == mail.subject
    v1 = {"user_id": "u1", "email": "jo@example.com", "name": "Jo Smith"}
    assert render("welcome", v1, event_version=1).subject == mail.subject
    # What the send path would dead-letter fails here too, with the same error.
    with pytest.raises(TemplateRenderError, match="first_name"):
        render("welcome", {"email": "jo@example.com"})
    with pytest.raises(TemplateRenderError, match=r"line break|header|subject"):
        render("welcome", {**payload, "first_name": "Jo\r\nBcc: x@example.com"})
    with pytest.raises(KeyError, match="no route 'nope'"):
        render("nope", payload)


def test_render_reads_a_products_own_table_and_templates(tmp_path: Path) -> None:
    version = tmp_path / "shipped" / "v1"
    version.mkdir(parents=True)
    (version / "subject.txt").write_text("Order {{ order_id }} is on its way")
    (version / "text.txt").write_text("Hello {{ first_name }}, order {{ order_id }} shipped.")
    table = RouteTable(
        routes=[
            Route(
                name="shipped",
                event_type="order.shipped",
                event_version=1,
                template="shipped",
                lane=Lane.TRANSACTIONAL,
            )
        ],
        templates_dir=tmp_path,
    )
    mail = render("shipped", {"order_id": 42, "first_name": "Jo"}, routes=table)
    assert mail.subject == "Order 42 is on its way"
    assert mail.text == "Hello Jo, order 42 shipped."
    assert mail.html is None
    bare = dataclasses.replace(table, templates_dir=None)
    with pytest.raises(ValueError, match="templates_dir"):
        render("shipped", {"order_id": 42}, routes=bare)
    given = render(
        "shipped", {"order_id": 1, "first_name": "A"}, routes=bare, templates_dir=tmp_path
    )
    assert given.subject == "Order 1 is on its way"
