"""One-click unsubscribe end to end, on SQLite and PostgreSQL: the real send job to the sandbox
over HTTP, the headers as the sandbox received them, the link POSTed to the receiver built from
the environment (as ``webhooks serve`` builds it), then the next bulk mail to that address is
suppressed while the password reset (critical) and a receipt (transactional) still go out: an
unsubscribe stops bulk mail only.
"""

import re
from datetime import timedelta

import pytest
from sqlalchemy import Engine
from starlette.testclient import TestClient

from email_platform.common import config
from email_platform.common.timeutil import utcnow
from email_platform.mail.unsubscribe import sign
from email_platform.store import messages, suppressions
from email_platform.webhooks.receiver import receiver_app_from_environment
from tests.support import (
    event,
    messages_of,
    publish_one,
    run_send,
    sandbox_messages,
    signup,
)

SECRET = "e2e-unsubscribe-secret-0123456789"
BASE_URL = "https://mail.example.test"
ADDRESS = "jane@example.com"
ONE_CLICK = {"content-type": "application/x-www-form-urlencoded"}
LINKS = re.compile(
    r"<https://mail\.example\.test(/unsubscribe/[A-Za-z0-9_.-]+)>, "
    r"<mailto:unsubscribe@example\.com\?subject=unsubscribe%20([A-Za-z0-9_.-]+)>"
)


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch, database_url: str) -> None:
    monkeypatch.setenv(config.PREFIX + "DATABASE_URL", database_url)
    monkeypatch.setenv(config.PREFIX + "UNSUBSCRIBE_SECRET", SECRET)
    monkeypatch.setenv(config.PREFIX + "UNSUBSCRIBE_BASE_URL", BASE_URL)


def _digest(engine: Engine, week: int) -> str:
    return publish_one(
        engine,
        event_type="digest.ready",
        aggregate_id=f"digest-{week}",
        payload={"email": ADDRESS, "first_name": "Jane", "highlights": ["a"]},
    )


def _reset(engine: Engine) -> str:
    return publish_one(
        engine,
        event_type="user.password_reset_requested",
        aggregate_id="u1",
        payload={"user_id": "u1", "reset_token": "t1"},
    )


def _receipt(engine: Engine) -> str:
    return publish_one(
        engine,
        event_type="order.paid",
        aggregate_id="order-1",
        payload={
            "email": ADDRESS,
            "first_name": "Jane",
            "order_id": "o_1",
            "items": [],
            "total": 0.0,
            "currency": "EUR",
        },
    )


def _sent(sandbox_url: str, event_id: str) -> dict:
    (message,) = sandbox_messages(sandbox_url, event_id)
    return message


def _send(database_url: str, sandbox_url: str, lane: str, event_id: str) -> None:
    assert run_send(database_url, sandbox_url, lane, [event_id]).success


def _suppressed(engine: Engine) -> dict[str, str]:
    with engine.connect() as connection:
        return suppressions.reasons_for(connection, [ADDRESS, "other@example.com"])


def test_one_click_unsubscribe_through_the_real_path(
    configured, engine, database_url, sandbox
) -> None:
    welcome = signup(engine, "u1", ADDRESS)
    digest = _digest(engine, 1)
    _send(database_url, sandbox.base_url, "transactional", welcome)
    _send(database_url, sandbox.base_url, "bulk", digest)

    welcome_headers = _sent(sandbox.base_url, welcome)["headers"]
    assert "List-Unsubscribe" not in welcome_headers
    assert "List-Unsubscribe-Post" not in welcome_headers
    headers = _sent(sandbox.base_url, digest)["headers"]
    assert headers["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    links = LINKS.fullmatch(headers["List-Unsubscribe"])
    assert links is not None, headers["List-Unsubscribe"]
    path, mailto_token = links.groups()
    assert path == "/unsubscribe/" + mailto_token

    receiver = TestClient(receiver_app_from_environment())
    # A scanner's GET changes nothing; the one-click POST suppresses the address.
    assert receiver.get(path).status_code == 200
    assert _suppressed(engine) == {}
    answer = receiver.post(path, content="List-Unsubscribe=One-Click", headers=ONE_CLICK)
    assert answer.status_code == 200
    assert _suppressed(engine) == {ADDRESS: "unsubscribe"}

    next_digest = _digest(engine, 2)
    _send(database_url, sandbox.base_url, "bulk", next_digest)
    assert [m.status for m in messages_of(engine, next_digest)] == [messages.SUPPRESSED]
    assert sandbox_messages(sandbox.base_url, next_digest) == []

    reset = _reset(engine)
    _send(database_url, sandbox.base_url, "critical", reset)
    assert [m.status for m in messages_of(engine, reset)] == [messages.SENT]
    assert "List-Unsubscribe" not in _sent(sandbox.base_url, reset)["headers"]

    # An unsubscribe stops bulk mail only: a receipt (transactional) still goes out.
    receipt = _receipt(engine)
    _send(database_url, sandbox.base_url, "transactional", receipt)
    assert [m.status for m in messages_of(engine, receipt)] == [messages.SENT]

    # Posting the same link again is answered 200 and changes nothing.
    answer = receiver.post(path, content="List-Unsubscribe=One-Click", headers=ONE_CLICK)
    assert answer.status_code == 200
    assert _suppressed(engine) == {ADDRESS: "unsubscribe"}


def test_an_expired_or_unconfigured_link_does_nothing(
    configured, engine, database_url, sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    expired = sign(SECRET, "other@example.com", "weekly_digest", utcnow() - timedelta(hours=1))
    receiver = TestClient(receiver_app_from_environment())
    answer = receiver.post(
        f"/unsubscribe/{expired}", content="List-Unsubscribe=One-Click", headers=ONE_CLICK
    )
    assert answer.status_code == 410
    assert _suppressed(engine) == {}

    # Without a secret the receiver answers 404, and bulk mail goes out without the headers.
    monkeypatch.delenv(config.PREFIX + "UNSUBSCRIBE_SECRET")
    valid = sign(SECRET, ADDRESS, "weekly_digest", utcnow() + timedelta(days=1))
    unconfigured = TestClient(receiver_app_from_environment())
    answer = unconfigured.post(
        f"/unsubscribe/{valid}", content="List-Unsubscribe=One-Click", headers=ONE_CLICK
    )
    assert answer.status_code == 404
    assert _suppressed(engine) == {}
    digest = _digest(engine, 1)
    _send(database_url, sandbox.base_url, "bulk", digest)
    headers = _sent(sandbox.base_url, digest)["headers"]
    assert "List-Unsubscribe" not in headers and "List-Unsubscribe-Post" not in headers


def test_a_bad_setting_fails_the_bulk_run_before_it_claims_anything(
    configured, engine, database_url, sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(config.PREFIX + "UNSUBSCRIBE_BASE_URL", "https://mail.example.test/a b")
    digest = _digest(engine, 1)
    assert not run_send(database_url, sandbox.base_url, "bulk", [digest]).success
    assert event(engine, digest).status == "pending"
    assert messages_of(engine, digest) == [] and sandbox_messages(sandbox.base_url) == []
    # Other lanes are not affected.
    welcome = signup(engine, "u1", ADDRESS)
    _send(database_url, sandbox.base_url, "transactional", welcome)
    assert "List-Unsubscribe" not in _sent(sandbox.base_url, welcome)["headers"]
