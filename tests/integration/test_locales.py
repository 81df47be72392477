"""Locales through the real send path (publish -> send job -> sandbox over HTTP), on SQLite and
PostgreSQL: each welcome goes out in the recipient's language after the fallback chain
(``pt-BR`` -> ``pt`` -> default), the locale used is recorded on the message, and a replay
renders the locale the message was made with.
"""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy import Engine, insert

from email_platform import publish
from email_platform.mail.routes import RouteTable, demo_routes
from email_platform.operating.admin import requeue_dead_letters
from email_platform.resources import RoutingResource
from tests.support import (
    dead_letters_of,
    messages_of,
    product,
    run_send,
    sandbox_messages,
    users,
)


def _signup(engine: Engine, user_id: str, locale: object) -> str:
    payload = {"user_id": user_id, "email": f"{user_id}@example.com", "first_name": "Ana"}
    if locale is not None:
        payload["locale"] = locale
    with engine.begin() as connection:
        product.create_all(connection)
        connection.execute(insert(users).values(id=user_id, email=payload["email"]))
        return publish(
            connection, event_type="user.signed_up", aggregate_id=user_id, payload=payload
        )


CASES = {
    "br": ("pt_br", "pt-BR", "Boas-vindas ao Example, Ana!"),
    "pt": ("pt-PT", "pt", "Bem-vindo ao Example, Ana!"),
    "fr": ("fr", None, "Welcome to Example, Ana!"),
    "none": (None, None, "Welcome to Example, Ana!"),
}


def test_each_welcome_is_sent_in_its_locale_and_the_locale_is_recorded(
    engine, database_url, sandbox
):
    ids = {name: _signup(engine, f"loc-{name}", asked) for name, (asked, _, _) in CASES.items()}
    result = run_send(database_url, sandbox.base_url, "transactional", list(ids.values()))
    assert result.success
    for name, (_, used, subject) in CASES.items():
        (message,) = messages_of(engine, ids[name])
        assert message.status == "sent"
        assert message.locale == used, name
        assert message.is_test is False
        (seen,) = sandbox_messages(sandbox.base_url, ids[name])
        assert seen["subject"] == subject, name
        assert ("Olá" in seen["text"] or "Oi" in seen["text"]) == (used is not None)


def test_a_v1_event_keeps_its_locale_through_the_upcaster(engine, database_url, sandbox):
    with engine.begin() as connection:
        product.create_all(connection)
        event_id = publish(
            connection,
            event_type="user.signed_up",
            event_version=1,
            aggregate_id="old-1",
            payload={
                "user_id": "old-1",
                "email": "old-1@example.com",
                "name": "Rui Costa",
                "locale": "pt",
            },
        )
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    (message,) = messages_of(engine, event_id)
    assert message.locale == "pt"
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    assert seen["subject"] == "Bem-vindo ao Example, Rui!"


def lookup_routes() -> RouteTable:
    """The demo's table with the welcome's locale looked up at send time (a preferences
    service): the payload's own locale still wins; a lookup that fails means the default."""
    table = demo_routes()

    def preferred(payload: Mapping[str, Any]) -> str | None:
        if payload["user_id"] == "look-down":
            raise ConnectionError("preferences service down")
        return {"look-br": "pt_BR", "look-bad": "pt\r\nBcc: x@example.com"}.get(payload["user_id"])

    table.routes = [
        replace(r, locale_lookup=preferred) if r.name == "welcome" else r for r in table.routes
    ]
    return table


def test_a_locale_lookup_answers_at_send_time_and_its_failures_send_the_default(
    engine, database_url, sandbox
):
    cases = {
        "look-br": (None, "pt-BR"),
        "look-own": ("pt", "pt"),  # the payload's field before the lookup
        "look-down": (None, None),
        "look-bad": (None, None),
        "look-none": (None, None),
    }
    ids = {user: _signup(engine, user, asked) for user, (asked, _) in cases.items()}
    routing = RoutingResource(routes_factory="tests.integration.test_locales:lookup_routes")
    result = run_send(
        database_url, sandbox.base_url, "transactional", list(ids.values()), routing=routing
    )
    assert result.success
    for user, (_, used) in cases.items():
        (message,) = messages_of(engine, ids[user])
        assert (message.status, message.locale) == ("sent", used), user
        (seen,) = sandbox_messages(sandbox.base_url, ids[user])
        assert seen["subject"].startswith("Welcome") == (used is None), user


def no_locale_routes() -> RouteTable:
    """The demo's table after its welcome stopped reading a locale."""
    table = demo_routes()
    table.routes = [
        replace(r, locale_field=None) if r.name == "welcome" else r for r in table.routes
    ]
    return table


def test_a_replay_renders_the_locale_the_message_was_made_with(engine, database_url, sandbox):
    # Refused once by the provider (a permanent 422), then accepted.
    event_id = _signup(engine, "loc+rejectx1", "pt-BR")
    assert not run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    letters = dead_letters_of(engine, event_id)
    assert [letter.reason for letter in letters] == ["provider_rejected"]
    requeue_dead_letters(engine, letters)
    routing = RoutingResource(routes_factory="tests.integration.test_locales:no_locale_routes")
    assert run_send(
        database_url, sandbox.base_url, "transactional", [event_id], routing=routing
    ).success
    (message,) = messages_of(engine, event_id)
    assert (message.status, message.locale) == ("sent", "pt-BR")
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    assert seen["subject"] == "Boas-vindas ao Example, Ana!"
