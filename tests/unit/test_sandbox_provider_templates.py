"""The sandbox renders the provider templates it knows, over a real loopback server, as a provider
does: the live (newest) or a pinned version, with the message's variables; an unknown template or
version, a bad template field and a failed rendering are 422s with a code naming the cause, in a
single send and per message in a batch. A folder of one's own can replace the shipped ones.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sandbox.templates import ProviderTemplates

VARIABLES = {
    "first_name": "Jane",
    "order_id": "O-1",
    "carrier": "DHL",
    "tracking_url": "https://track.example.com/O-1",
}


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with (
        SandboxServer(SandboxConfig()) as url,
        httpx.Client(base_url=url, timeout=5.0) as client,
    ):
        yield client


def body(template: Any) -> dict[str, Any]:
    return {
        "from": "no-reply@example.com",
        "to": "jane@example.com",
        "subject": "",
        "text": "",
        "template": template,
    }


def send(client: httpx.Client, key: str, template: Any) -> httpx.Response:
    return client.post("/v1/send", json=body(template), headers={"Idempotency-Key": key})


def stored(client: httpx.Client, message_id: str) -> dict[str, Any]:
    messages = client.get("/_sandbox/messages").json()["messages"]
    return next(m for m in messages if m["id"] == message_id)


@pytest.mark.parametrize(
    ("version", "subject"),
    [
        (None, "Good news, Jane: order O-1 has shipped"),
        (1, "Order O-1 has shipped"),
        ("v1", "Order O-1 has shipped"),
        (2, "Good news, Jane: order O-1 has shipped"),
    ],
)
def test_the_live_or_the_pinned_version_is_rendered_with_the_variables(client, version, subject):
    answer = send(
        client,
        f"k-{version}",
        {"id": "shipping-notice", "version": version, "variables": VARIABLES},
    )
    assert answer.status_code == 200, answer.text
    message = stored(client, answer.json()["id"])
    assert message["subject"] == subject
    assert "DHL" in message["text"] and "https://track.example.com/O-1" in message["html"]


@pytest.mark.parametrize(
    ("template", "code", "named"),
    [
        ({"id": "no-such", "variables": {}}, "template_not_found", "no-such"),
        ({"id": "../templates", "variables": {}}, "template_not_found", "../templates"),
        ({"id": "shipping-notice", "version": 9, "variables": VARIABLES}, "template_not_found", ""),
        ({"id": "shipping-notice", "version": "latest", "variables": {}}, "invalid_request", ""),
        ({"id": "shipping-notice", "variables": {"first_name": "J"}}, "template_error", "order_id"),
        ({"id": "shipping-notice", "variables": [1]}, "invalid_request", ""),
        ("shipping-notice", "invalid_request", ""),
        (
            {"id": "shipping-notice", "variables": {**VARIABLES, "first_name": "J\r\nBcc: x@y.z"}},
            "template_error",
            "subject",
        ),
    ],
)
def test_what_cannot_be_rendered_is_a_422_naming_the_cause(client, template, code, named):
    answer = send(client, f"bad-{code}-{named}", template)
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == code and named in error["message"]


def test_a_batch_answers_each_message_alone(client):
    good = {**body({"id": "shipping-notice", "variables": VARIABLES}), "idempotency_key": "b1"}
    bad = {**body({"id": "no-such", "variables": {}}), "idempotency_key": "b2"}
    answer = client.post(
        "/v1/send/batch", json={"messages": [good, bad, {**good, "idempotency_key": "b3"}]}
    )
    statuses = [(r["status"], (r.get("error") or {}).get("code")) for r in answer.json()["results"]]
    assert statuses == [(200, None), (422, "template_not_found"), (200, None)]


def test_a_folder_of_ones_own_replaces_the_shipped_templates(tmp_path: Path):
    (tmp_path / "hello" / "v3").mkdir(parents=True)
    (tmp_path / "hello" / "v3" / "subject.txt").write_text("Hello {{ name }}")
    (tmp_path / "hello" / "v3" / "text.txt").write_text("Hi {{ name }}")
    templates = ProviderTemplates(tmp_path)
    payload: dict[str, Any] = {"template": {"id": "hello", "variables": {"name": "Ada"}}}
    assert templates.fill(payload) is None
    assert (payload["subject"], payload["text"], payload["html"]) == ("Hello Ada", "Hi Ada", None)
    assert templates.fill({"template": {"id": "shipping-notice", "variables": {}}})[1] == (  # type: ignore[index]
        "template_not_found"
    )
