"""Locales: the tag publish() takes, its fallback chain and the templates each locale renders.

publish() refuses a payload locale that is not a tag (``InvalidLocaleError`` naming the field)
before any write; a tag is normalized (``pt_br`` -> ``pt-BR``); the renderer uses the first
locale of ``pt-BR`` -> ``pt`` -> default that has files, never a path outside the version.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, create_engine, inspect

from email_platform import publish
from email_platform.common.errors import PublishError
from email_platform.mail import locales
from email_platform.mail.locales import InvalidLocaleError
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import Route, demo_routes
from email_platform.testing import render


@pytest.fixture
def tableless() -> Iterator[Connection]:
    engine = create_engine("sqlite://")
    with engine.begin() as connection:
        yield connection
    engine.dispose()


def _signup(locale: Any) -> dict[str, Any]:
    return {
        "event_type": "user.signed_up",
        "aggregate_id": "user_1",
        "payload": {
            "email": "jane@example.com",
            "first_name": "Jane",
            "user_id": "u1",
            "locale": locale,
        },
    }


@pytest.mark.parametrize(
    ("raw", "tag"),
    [
        ("pt-BR", "pt-BR"),
        ("pt_br", "pt-BR"),
        ("PT", "pt"),
        ("zh_hant_tw", "zh-Hant-TW"),
        ("es-419", "es-419"),
        ("fil", "fil"),
    ],
)
def test_a_tag_is_normalized(raw: str, tag: str) -> None:
    assert locales.normalize(raw) == tag
    assert locales.check_locale("payload.locale", raw) == tag


@pytest.mark.parametrize(
    "bad",
    [
        "pt-BR\r\nBcc: x@example.com",
        "pt-BR\n",
        "../../etc",
        "pt/BR",
        "ptèBR",
        "pt--BR",
        "p",
        "portuguese",
        "pt-BR-x-private",
        " pt",
        "pt ",
        "p" * 40,
        7,
        1.5,
        ["pt"],
        {"pt": 1},
    ],
)
def test_publish_refuses_a_locale_that_is_not_a_tag_naming_the_field(
    tableless: Connection, bad: Any
) -> None:
    with pytest.raises(PublishError) as info:
        publish(tableless, **_signup(bad))
    assert info.value.field == "payload.locale"
    assert inspect(tableless).get_table_names() == []  # refused before any write


def test_the_locale_error_is_typed() -> None:
    with pytest.raises(InvalidLocaleError) as info:
        locales.check_locale("payload.locale", "pt\r\nX: y")
    assert isinstance(info.value, ValueError) and info.value.field == "payload.locale"


@pytest.mark.parametrize("empty", [None, ""])
def test_no_locale_means_the_default(empty: Any) -> None:
    assert locales.check_locale("payload.locale", empty) is None


@settings(max_examples=300, deadline=None, database=None)
@given(
    value=st.one_of(
        st.text(max_size=40),
        st.from_regex(r"[a-zA-Z]{2,3}([-_][a-zA-Z0-9]{2,4}){0,2}", fullmatch=True),
    )
)
def test_any_text_is_a_safe_tag_or_refused_naming_the_field(value: str) -> None:
    try:
        tag = locales.check_locale("payload.locale", value)
    except PublishError as refused:
        assert refused.field == "payload.locale"
        return
    if tag is None:
        assert value == ""
        return
    # What is kept fits the column, names no path and can sit in no header break.
    assert len(tag) <= locales.MAX_LENGTH and tag.isascii()
    assert all(part.isalnum() for part in tag.split("-"))
    assert locales.normalize(tag) == tag


def test_the_fallback_chain() -> None:
    assert locales.fallback_chain("zh-Hant-TW") == ["zh-Hant-TW", "zh-Hant", "zh"]
    assert locales.fallback_chain("pt-BR") == ["pt-BR", "pt"]
    assert locales.fallback_chain(None) == []


def _welcome(**changes: Any) -> Route:
    return (
        demo_routes()
        .route("welcome")
        .__class__(**{**demo_routes().route("welcome").__dict__, **changes})
    )


PAYLOAD = {"user_id": "u1", "email": "a@example.com", "first_name": "Ana"}


@pytest.mark.parametrize(
    ("asked", "used", "subject"),
    [
        ("pt-BR", "pt-BR", "Boas-vindas ao Example, Ana!"),
        ("pt_PT", "pt", "Bem-vindo ao Example, Ana!"),
        ("pt", "pt", "Bem-vindo ao Example, Ana!"),
        ("fr-CA", None, "Welcome to Example, Ana!"),
        (None, None, "Welcome to Example, Ana!"),
        ("../welcome", None, "Welcome to Example, Ana!"),
    ],
)
def test_the_demo_welcome_falls_back_pt_br_pt_default(
    asked: str | None, used: str | None, subject: str
) -> None:
    renderer = TemplateRenderer()
    route = demo_routes().route("welcome")
    payload = {**PAYLOAD, "locale": asked}
    assert locales.used_for(renderer, route, payload, 1) == used
    rendered = renderer.render("welcome", 1, payload, locales.requested(route, payload))
    assert rendered.subject == subject and rendered.locale == used
    assert rendered.html is not None and ('lang="pt' in rendered.html) == (used is not None)


def test_a_lookup_answers_when_the_payload_has_none_and_its_failure_means_default() -> None:
    renderer = TemplateRenderer()
    route = _welcome(locale_lookup=lambda payload: "pt-BR" if payload["user_id"] == "u1" else None)
    assert locales.used_for(renderer, route, PAYLOAD, 1) == "pt-BR"
    assert locales.used_for(renderer, route, {**PAYLOAD, "locale": "pt"}, 1) == "pt"

    def broken(payload: Any) -> str:
        raise ConnectionError("directory down")

    assert locales.used_for(renderer, _welcome(locale_lookup=broken), PAYLOAD, 1) is None
    assert (
        locales.used_for(renderer, _welcome(locale_lookup=lambda p: "x\r\ny"), PAYLOAD, 1) is None
    )


def test_a_locale_directory_is_complete_no_part_falls_back_alone(tmp_path: Path) -> None:
    for name, content in {
        "t/v1/subject.txt": "Hello",
        "t/v1/text.txt": "Hi",
        "t/v1/html.html": "<p>Hi</p>",
        "t/v1/de/subject.txt": "Hallo",
        "t/v1/de/text.txt": "Hallo du",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    rendered = TemplateRenderer(tmp_path).render("t", None, {}, "de-AT")
    assert (rendered.subject, rendered.text, rendered.html, rendered.locale) == (
        "Hallo",
        "Hallo du",
        None,
        "de",
    )
    default = TemplateRenderer(tmp_path).render("t", None, {}, None)
    assert (default.subject, default.html, default.locale) == ("Hello", "<p>Hi</p>", None)


def test_the_testing_kit_renders_a_locale() -> None:
    rendered = render("welcome", {**PAYLOAD, "locale": "pt-BR"}, routes=demo_routes())
    assert rendered.subject == "Boas-vindas ao Example, Ana!"
