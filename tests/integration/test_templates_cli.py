"""``email-platform templates render|send-test``: a preview without a database, and one real
test send through the configured provider (the sandbox over HTTP) on SQLite and PostgreSQL,
recorded as a test that trace shows and the warehouse's funnel leaves out.
"""

import base64
import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, insert, select

from email_platform import warehouse
from email_platform.cli import main
from email_platform.db.schema import email_attempts, email_events, email_messages
from email_platform.mail.routes import DEMO_ROUTES
from tests.support import event, messages_of, run_send, sandbox_messages, signup

PAYLOAD = {"user_id": "u1", "email": "ana@example.com", "first_name": "Ana", "locale": "pt_BR"}


def _invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(
        main, list(args), env={"EMAIL_PLATFORM_ROUTES": DEMO_ROUTES, **(env or {})}
    )


def _file(tmp_path: Path, content: str, name: str = "payload.json") -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def test_render_prints_subject_text_and_html_in_the_payloads_locale(tmp_path: Path) -> None:
    result = _invoke(
        "templates", "render", "welcome", "--payload", _file(tmp_path, json.dumps(PAYLOAD))
    )
    assert result.exit_code == 0, result.output
    assert "locale: pt-BR" in result.output
    assert "subject: Boas-vindas ao Example, Ana!" in result.output
    assert "Valeu por se cadastrar" in result.output  # text
    assert '<html lang="pt-BR">' in result.output  # html


@pytest.mark.parametrize(
    ("locale", "used", "subject"),
    [("pt-PT", "pt", "Bem-vindo ao Example, Ana!"), ("de", None, "Welcome to Example, Ana!")],
)
def test_render_locale_option_follows_the_fallback_chain(
    tmp_path: Path, locale: str, used: str | None, subject: str
) -> None:
    result = _invoke(
        "templates",
        "render",
        "welcome",
        "--payload",
        _file(tmp_path, json.dumps(PAYLOAD)),
        "--locale",
        locale,
        "--json",
    )
    assert result.exit_code == 0, result.output
    rendered = json.loads(result.output)
    assert (rendered["locale"], rendered["subject"]) == (used, subject)
    assert rendered["text"] and rendered["html"]


@pytest.mark.parametrize(
    ("args", "content", "says"),
    [
        (["nope"], json.dumps(PAYLOAD), "no route 'nope'"),
        (["welcome"], "{not json", "not JSON"),
        (["welcome"], "[1, 2]", "must hold a JSON object"),
        (["welcome"], json.dumps({"user_id": "u1"}), "'first_name' is undefined"),
        (
            ["welcome", "--locale", "pt\r\nBcc: x@example.com"],
            json.dumps(PAYLOAD),
            "not a language tag",
        ),
        (["welcome", "--locale", "../../etc"], json.dumps(PAYLOAD), "not a language tag"),
        (["welcome"], json.dumps({**PAYLOAD, "locale": "pt\r\nX: y"}), "payload.locale"),
    ],
)
def test_render_says_what_is_wrong_without_a_traceback(
    tmp_path: Path, args: list[str], content: str, says: str
) -> None:
    result = _invoke(
        "templates", "render", *args[:1], "--payload", _file(tmp_path, content), *args[1:]
    )
    assert result.exit_code != 0
    assert says in result.output
    assert "Traceback" not in result.output and not isinstance(
        result.exception, (KeyError, ValueError)
    )


def test_render_needs_a_payload_file_that_exists(tmp_path: Path) -> None:
    result = _invoke("templates", "render", "welcome", "--payload", str(tmp_path / "missing.json"))
    assert result.exit_code == 2 and "No such file" in result.output


def _send_env(database_url: str, sandbox_url: str) -> dict[str, str]:
    return {
        "EMAIL_PLATFORM_DATABASE_URL": database_url,
        "EMAIL_PLATFORM_PROVIDER": "sandbox",
        "EMAIL_PLATFORM_SANDBOX_BASE_URL": sandbox_url,
    }


def test_send_test_sends_one_message_recorded_as_a_test_and_out_of_the_funnel(
    engine: Engine, database_url: str, sandbox, tmp_path: Path
) -> None:
    env = _send_env(database_url, sandbox.base_url)
    # A real welcome too: the funnel keeps it. The warehouse has it before the test is sent,
    # so the test send reaches it by an incremental refresh, as in a running deployment.
    real = signup(engine, "real-1")
    assert run_send(database_url, sandbox.base_url, "transactional", [real]).success
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(database_url, path)
    sent = _invoke(
        "templates", "send-test", "welcome", "--to", "qa@example.com",
        "--payload", _file(tmp_path, json.dumps(PAYLOAD)), "--json", env=env,
    )  # fmt: skip
    assert sent.exit_code == 0, sent.output
    answer = json.loads(sent.output)
    (seen,) = sandbox_messages(sandbox.base_url, answer["event_id"])
    assert seen["id"] == answer["provider_message_id"]
    assert seen["to"] == "qa@example.com"  # --to wins over the payload's address
    assert seen["subject"] == "Boas-vindas ao Example, Ana!"
    assert seen["headers"]["X-Email-Test-Send"] == "1"
    (message,) = messages_of(engine, answer["event_id"])
    assert message.is_test is True and message.locale == "pt-BR"
    assert message.status == "sent" and message.provider_message_id == seen["id"]
    test_event = event(engine, answer["event_id"])
    assert (test_event.status, test_event.resolution) == ("done", "test")
    with engine.connect() as connection:
        (attempt,) = connection.execute(
            select(email_attempts).where(email_attempts.c.message_id == message.message_id)
        ).all()
    assert attempt.outcome == "accepted"
    # The provider's webhooks about the test (delivered, opened) are stored like any others.
    with engine.begin() as connection:
        for kind in ("delivered", "opened"):
            connection.execute(
                insert(email_events).values(
                    provider="sandbox",
                    provider_event_id=f"{seen['id']}:{kind}",
                    event_type=kind,
                    occurred_at=message.sent_at,
                    received_at=message.sent_at,
                    event_id=answer["event_id"],
                    message_id=message.message_id,
                    provider_message_id=seen["id"],
                    recipient_domain="example.com",
                )
            )

    traced = _invoke("trace", answer["event_id"], env=env)
    assert traced.exit_code == 0, traced.output
    assert "TEST SEND" in traced.output and "locale=pt-BR" in traced.output
    assert "(test)" in traced.output

    for full in (False, True):  # the incremental refresh, then a rebuild: the same answer
        warehouse.refresh(database_url, path, full=full)
        connection = warehouse.connect_read_only(path)
        try:
            funnel = connection.execute("SELECT event_id, locale FROM email_funnel").fetchall()
            daily = connection.execute("SELECT sum(messages) FROM email_funnel_daily").fetchone()
            in_views = {
                view: connection.execute(
                    f"SELECT count(*) FROM {view} WHERE event_id = ?", [answer["event_id"]]
                ).fetchone()[0]
                for view in ("stg_sends", "stg_events", "stg_attempts", "stg_provider_events")
            }
            raw = connection.execute(
                "SELECT is_test, locale FROM raw_email_messages WHERE event_id = ?",
                [answer["event_id"]],
            ).fetchall()
        finally:
            connection.close()
        assert funnel == [(real, None)], full
        assert daily == (1,), full
        assert in_views == dict.fromkeys(in_views, 0), full
        assert raw == [(True, "pt-BR")], full  # loaded, and left out by the views


def test_send_test_defaults_to_the_schema_example_and_names_a_refusal(
    engine: Engine, database_url: str, sandbox
) -> None:
    env = _send_env(database_url, sandbox.base_url)
    ok = _invoke("templates", "send-test", "welcome", "--to", "qa@example.com", env=env)
    assert ok.exit_code == 0, ok.output
    assert "sent test message" in ok.output and "locale pt-BR" in ok.output  # the example's
    refused = _invoke("templates", "send-test", "welcome", "--to", "qa+reject@example.com", env=env)
    assert refused.exit_code == 1 and "refused the test message" in refused.output
    with engine.connect() as connection:
        statuses = sorted(
            connection.execute(
                select(email_messages.c.status).where(email_messages.c.is_test)
            ).scalars()
        )
    assert statuses == ["dead", "sent"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nope", "--to", "qa@example.com"], "no route 'nope'"),
        (["welcome", "--to", "qa@example.com\r\nBcc: x@example.com"], "to:"),
        (["welcome", "--to", "not-an-address"], "to:"),
        (["welcome", "--to", "qa@example.com", "--locale", "x y"], "not a language tag"),
        (["welcome", "--to", "qa@example.com", "--payload", "NUL"], "payload.first_name"),
        (["welcome", "--to", "qa@example.com", "--payload", "LOCALE"], "payload.locale"),
    ],
)
def test_send_test_refuses_before_writing_or_sending(
    engine: Engine, database_url: str, sandbox, tmp_path: Path, args: list[str], says: str
) -> None:
    payloads = {
        "NUL": {**PAYLOAD, "first_name": "Ana\x00"},  # PostgreSQL's JSON cannot store it
        "LOCALE": {**PAYLOAD, "locale": "pt\r\nBcc: x@example.com"},
    }
    args = [_file(tmp_path, json.dumps(payloads[arg])) if arg in payloads else arg for arg in args]
    result = _invoke("templates", "send-test", *args, env=_send_env(database_url, sandbox.base_url))
    assert result.exit_code != 0 and says in result.output, result.output
    assert sandbox_messages(sandbox.base_url) == []
    with engine.connect() as connection:
        assert connection.execute(select(email_messages)).all() == []


SHIPPED = {
    "email": "ana@example.com",
    "order_id": "O-7",
    "first_name": "Ana",
    "carrier": "DHL",
    "tracking_url": "https://track.example/O-7",
}


def test_render_shows_the_provider_template_call_and_the_local_fallback(tmp_path: Path) -> None:
    payload = _file(tmp_path, json.dumps(SHIPPED))
    result = _invoke("templates", "render", "shipping_notice", "--payload", payload, "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["provider_template"] == {
        "id": "shipping-notice",
        "version": None,
        "variables": {k: SHIPPED[k] for k in ("first_name", "order_id", "carrier", "tracking_url")},
    }
    assert shown["template"] == "shipping_notice"  # the local fallback SMTP sends
    text = _invoke("templates", "render", "shipping_notice", "--payload", payload)
    assert text.exit_code == 0, text.output
    assert text.output.startswith("provider template: shipping-notice (live)")


def test_render_of_a_provider_template_route_names_a_missing_variable(tmp_path: Path) -> None:
    payload = _file(tmp_path, json.dumps({k: v for k, v in SHIPPED.items() if k != "carrier"}))
    result = _invoke("templates", "render", "shipping_notice", "--payload", payload)
    assert result.exit_code == 1
    assert "carrier" in result.output and "Traceback" not in result.output


def test_send_test_sends_the_mail_as_the_route_addresses_it_with_its_files(
    database_url: str, sandbox, tmp_path: Path
) -> None:
    # The schema example of order.paid: the receipt from billing@, Reply-To support, its PDF.
    sent = _invoke(
        "templates", "send-test", "receipt", "--to", "qa@example.com", "--json",
        env=_send_env(database_url, sandbox.base_url),
    )  # fmt: skip
    assert sent.exit_code == 0, sent.output
    (seen,) = sandbox_messages(sandbox.base_url, json.loads(sent.output)["event_id"])
    assert seen["from"] == "Shop billing <billing@example.com>"
    assert seen["reply_to"] == ["Shop support <support@example.com>"]
    (pdf,) = seen["attachments"]
    assert pdf["content_type"] == "application/pdf"
    assert base64.b64decode(pdf["content"]).startswith(b"%PDF-1.4")


def test_send_test_of_a_provider_template_route_sends_the_template_the_provider_renders(
    engine: Engine, database_url: str, sandbox, tmp_path: Path
) -> None:
    payload = _file(tmp_path, json.dumps(SHIPPED))
    sent = _invoke(
        "templates", "send-test", "shipping_notice", "--to", "qa@example.com",
        "--payload", payload, "--json", env=_send_env(database_url, sandbox.base_url),
    )  # fmt: skip
    assert sent.exit_code == 0, sent.output
    event_id = json.loads(sent.output)["event_id"]
    (seen,) = sandbox_messages(sandbox.base_url, event_id)
    # The sandbox rendered its own live version, as for the route's real mail; the local
    # fallback (what SMTP sends) is not what went out.
    assert seen["subject"] == "Good news, Ana: order O-7 has shipped"
    assert seen["metadata"]["template"] == "shipping-notice"
    (message,) = messages_of(engine, event_id)
    assert (message.template, message.template_version, message.status) == (
        "shipping-notice",
        0,
        "sent",
    )
