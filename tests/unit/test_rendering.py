"""Unit tests of ``TemplateRenderer``: the shipped templates, escaping, failures and versions.

Every shipped template renders a realistic payload into the expected subject and bodies; HTML
autoescapes what text leaves alone; every failure is a permanent ``TemplateRenderError`` whose
``code`` tells an operator what to fix (``template_error``, ``template_missing``,
``header_injection``); and versioned template directories resolve the newest or a pinned one.
"""

from pathlib import Path
from typing import Any

import pytest

from email_platform.common.errors import PermanentError, TemplateRenderError, TransientError
from email_platform.mail.rendering import TemplateRenderer

SCRIPT = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def renderer() -> TemplateRenderer:
    return TemplateRenderer()


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


def _render_error(renderer: TemplateRenderer, *args: Any) -> TemplateRenderError:
    with pytest.raises(TemplateRenderError) as info:
        renderer.render(*args)
    assert isinstance(info.value, PermanentError)
    assert not isinstance(info.value, TransientError)
    assert info.value.reason == "template_error"
    return info.value


# --- shipped templates ------------------------------------------------------------------------


def test_welcome(renderer: TemplateRenderer) -> None:
    mail = renderer.render("welcome", None, {"first_name": "Jane", "user_id": "user_abc123"})
    assert mail.subject == "Welcome to Example, Jane!"
    assert mail.text.startswith("Hi Jane,\n")
    assert "Your account user_abc123 is ready." in mail.text
    assert mail.html is not None
    assert "<p>Hi Jane,</p>" in mail.html
    assert "<code>user_abc123</code>" in mail.html
    assert (mail.template, mail.template_version) == ("welcome", 1)


def test_password_reset(renderer: TemplateRenderer) -> None:
    mail = renderer.render("password_reset", None, {"reset_token": "abc/def+g=&x"})
    assert mail.subject == "Reset your Example password"
    assert "https://app.example.com/reset?token=abc/def+g=&x\n" in mail.text
    assert mail.html is not None
    # The token is URL-encoded inside the href, so '+', '=' and '&' cannot change the query.
    assert 'href="https://app.example.com/reset?token=abc/def%2Bg%3D%26x"' in mail.html
    assert "15 minutes" in mail.text


def test_receipt(renderer: TemplateRenderer) -> None:
    payload = {
        "first_name": "Jane",
        "order_id": "ord_42",
        "currency": "EUR",
        "total": 30.0,
        "items": [
            {"name": "Mug", "quantity": 2, "unit_price": 12.5},
            {"name": "Tea", "quantity": 1, "unit_price": 5},
        ],
    }
    mail = renderer.render("receipt", None, payload)
    assert mail.subject == "Your receipt for order ord_42"
    assert "Hi Jane," in mail.text
    assert "  2 x Mug  12.50 EUR" in mail.text
    assert "  1 x Tea  5.00 EUR" in mail.text
    assert mail.text.rstrip().endswith("Total: 30.00 EUR")
    assert mail.html is not None
    assert "<td>2 &times; Mug</td><td>12.50 EUR</td>" in mail.html
    assert "<strong>30.00 EUR</strong>" in mail.html
    assert "<strong>ord_42</strong>" in mail.html


def test_weekly_digest(renderer: TemplateRenderer) -> None:
    highlights = ["3 new followers", "Your post got 12 likes", "Tom <Ops> replied"]
    mail = renderer.render("weekly_digest", None, {"first_name": "Jane", "highlights": highlights})
    assert mail.subject == "Jane, your week on Example"
    assert "This week: 3 things happened." in mail.text
    for line in highlights:
        assert f"- {line}\n" in mail.text
    assert mail.html is not None
    assert "<li>3 new followers</li>" in mail.html
    assert "<li>Tom &lt;Ops&gt; replied</li>" in mail.html
    assert "https://app.example.com/unsubscribe" in mail.text


def test_weekly_digest_with_no_highlights(renderer: TemplateRenderer) -> None:
    mail = renderer.render("weekly_digest", None, {"first_name": "Jane", "highlights": []})
    assert "This week: 0 things happened." in mail.text
    assert mail.html is not None
    assert "<ul></ul>" in mail.html


def test_html_autoescapes_but_text_does_not(renderer: TemplateRenderer) -> None:
    mail = renderer.render("welcome", None, {"first_name": SCRIPT, "user_id": "u1"})
    assert mail.html is not None
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in mail.html
    assert "<script>" not in mail.html
    assert f"Hi {SCRIPT}," in mail.text
    assert mail.subject == f"Welcome to Example, {SCRIPT}!"


def test_html_escapes_attribute_breakers(renderer: TemplateRenderer) -> None:
    mail = renderer.render("welcome", None, {"first_name": "Jane", "user_id": "\"' onload=x"})
    assert mail.html is not None
    assert "&#34;&#39; onload=x" in mail.html
    assert "\"' onload" not in mail.html


def test_renderer_does_not_mutate_the_payload(renderer: TemplateRenderer) -> None:
    payload = {"first_name": "Jane", "user_id": "u1"}
    renderer.render("welcome", None, payload)
    assert payload == {"first_name": "Jane", "user_id": "u1"}


# --- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "payload", "missing"),
    [
        ("welcome", {"user_id": "u1"}, "first_name"),
        ("welcome", {"first_name": "Jane"}, "user_id"),
        ("password_reset", {}, "reset_token"),
        ("receipt", {"first_name": "J", "order_id": "o", "currency": "EUR", "total": 1}, "items"),
        ("weekly_digest", {"first_name": "Jane"}, "highlights"),
    ],
)
def test_missing_variable_is_template_error(
    renderer: TemplateRenderer, template: str, payload: dict[str, Any], missing: str
) -> None:
    error = _render_error(renderer, template, None, payload)
    assert error.code == "template_error"
    assert missing in str(error)
    assert f"{template}/v1" in str(error)


def test_missing_attribute_of_an_item_is_template_error(renderer: TemplateRenderer) -> None:
    payload = {
        "first_name": "Jane",
        "order_id": "o1",
        "currency": "EUR",
        "total": 1.0,
        "items": [{"name": "Mug", "quantity": 1}],  # no unit_price
    }
    assert _render_error(renderer, "receipt", None, payload).code == "template_error"


def test_wrong_type_in_a_filter_is_template_error(renderer: TemplateRenderer) -> None:
    payload = {
        "first_name": "Jane",
        "order_id": "o1",
        "currency": "EUR",
        "total": "thirty",  # "%.2f" | format(...) needs a number
        "items": [],
    }
    assert _render_error(renderer, "receipt", None, payload).code == "template_error"


@pytest.mark.parametrize("template", ["nope", "welcome/../nope", ""])
def test_missing_template_is_template_missing(renderer: TemplateRenderer, template: str) -> None:
    error = _render_error(renderer, template, None, {"first_name": "Jane", "user_id": "u1"})
    assert error.code == "template_missing"


def test_missing_pinned_version_is_template_missing(renderer: TemplateRenderer) -> None:
    error = _render_error(renderer, "welcome", 9, {"first_name": "Jane", "user_id": "u1"})
    assert error.code == "template_missing"
    assert "welcome/v9" in str(error)


@pytest.mark.parametrize("name", ["Jane\nBcc: victim@example.org", "Jane\r\nX: y", "Ja\rne"])
def test_line_break_in_subject_is_header_injection(renderer: TemplateRenderer, name: str) -> None:
    error = _render_error(renderer, "welcome", None, {"first_name": name, "user_id": "u1"})
    assert error.code == "header_injection"


def test_line_break_in_body_only_is_fine(renderer: TemplateRenderer) -> None:
    mail = renderer.render("welcome", None, {"first_name": "Jane", "user_id": "u1\nu2"})
    assert "u1\nu2" in mail.text


def test_syntax_error_is_template_error(tmp_path: Path) -> None:
    _write(tmp_path, {"t/v1/subject.txt": "Hello {{ name ", "t/v1/text.txt": "x"})
    error = _render_error(TemplateRenderer(tmp_path), "t", None, {"name": "Jane"})
    assert error.code == "template_error"


def test_missing_text_part_is_template_missing(tmp_path: Path) -> None:
    _write(tmp_path, {"t/v1/subject.txt": "Hello"})
    error = _render_error(TemplateRenderer(tmp_path), "t", None, {})
    assert error.code == "template_missing"
    assert "text.txt" in str(error)


# --- versions ---------------------------------------------------------------------------------


@pytest.fixture
def versioned(tmp_path: Path) -> TemplateRenderer:
    _write(
        tmp_path,
        {
            "t/v1/subject.txt": "v1 subject for {{ name }}\n",
            "t/v1/text.txt": "v1 body {{ name }}",
            "t/v2/subject.txt": "v2 subject for {{ name }}",
            "t/v2/text.txt": "v2 body {{ name }}",
            "t/v2/html.html": "<p>v2 {{ name }}</p>",
        },
    )
    return TemplateRenderer(tmp_path)


def test_latest_version(versioned: TemplateRenderer) -> None:
    assert versioned.latest_version("t") == 2


def test_unpinned_renders_the_latest(versioned: TemplateRenderer) -> None:
    mail = versioned.render("t", None, {"name": "Jane"})
    assert (mail.subject, mail.text, mail.html) == (
        "v2 subject for Jane",
        "v2 body Jane",
        "<p>v2 Jane</p>",
    )
    assert mail.template_version == 2


def test_pinned_version_renders_that_version(versioned: TemplateRenderer) -> None:
    mail = versioned.render("t", 1, {"name": "Jane"})
    assert mail.subject == "v1 subject for Jane"  # trailing newline of the file stripped
    assert mail.text == "v1 body Jane"
    assert mail.html is None  # v1 has no HTML part
    assert mail.template_version == 1


def test_versions_compare_as_numbers_and_other_dirs_are_ignored(tmp_path: Path) -> None:
    files = {f"t/{d}/{p}": d for d in ("v2", "v10", "v9") for p in ("subject.txt", "text.txt")}
    files["t/draft/subject.txt"] = "draft"
    files["t/vx/subject.txt"] = "vx"
    renderer = TemplateRenderer(_write(tmp_path, files))
    assert renderer.latest_version("t") == 10
    assert renderer.render("t", None, {}).subject == "v10"


def test_latest_version_of_a_missing_template(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    renderer = TemplateRenderer(tmp_path)
    for name in ("empty", "absent"):
        with pytest.raises(TemplateRenderError) as info:
            renderer.latest_version(name)
        assert info.value.code == "template_missing"
