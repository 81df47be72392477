"""``TemplateRenderer`` loads each template version once per instance.

A batch renders the same version thousands of times: after the first render the version is
served from memory (shown here by removing its files), a new instance loads from disk again,
and a version that failed to load is not remembered as loaded.
"""

import shutil
from pathlib import Path

import pytest

from email_platform.common.errors import TemplateRenderError
from email_platform.mail.rendering import TemplateRenderer


def _write(root: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def test_a_loaded_version_renders_without_reading_its_files_again(tmp_path: Path):
    _write(
        tmp_path,
        {
            "t/v1/subject.txt": "Hi {{ name }}",
            "t/v1/text.txt": "Hello {{ name }}",
            "t/v1/html.html": "<p>{{ name }}</p>",
        },
    )
    renderer = TemplateRenderer(tmp_path)
    first = renderer.render("t", None, {"name": "Jane"})
    shutil.rmtree(tmp_path / "t")
    again = renderer.render("t", 1, {"name": "<Joe>"})
    assert (first.subject, first.text, first.html) == ("Hi Jane", "Hello Jane", "<p>Jane</p>")
    assert (again.subject, again.text, again.html) == (
        "Hi <Joe>",
        "Hello <Joe>",
        "<p>&lt;Joe&gt;</p>",
    )
    with pytest.raises(TemplateRenderError) as info:
        TemplateRenderer(tmp_path).render("t", 1, {"name": "Jane"})
    assert info.value.code == "template_missing"


def test_a_version_without_html_stays_text_only(tmp_path: Path):
    _write(tmp_path, {"t/v1/subject.txt": "Hi", "t/v1/text.txt": "Hello {{ name }}"})
    renderer = TemplateRenderer(tmp_path)
    for name in ("Jane", "Joe"):
        mail = renderer.render("t", None, {"name": name})
        assert (mail.text, mail.html) == (f"Hello {name}", None)


def test_a_version_that_failed_to_load_is_loaded_again_once_fixed(tmp_path: Path):
    _write(tmp_path, {"t/v1/subject.txt": "Hi {{ name ", "t/v1/text.txt": "Hello"})
    renderer = TemplateRenderer(tmp_path)
    with pytest.raises(TemplateRenderError) as info:
        renderer.render("t", 1, {"name": "Jane"})
    assert info.value.code == "template_error"
    _write(tmp_path, {"t/v1/subject.txt": "Hi {{ name }}"})
    assert renderer.render("t", 1, {"name": "Jane"}).subject == "Hi Jane"


def test_templates_render_exactly_as_jinja_renders_them_with_its_globals(tmp_path: Path):
    """Loaded versions keep Jinja's globals (``range``, ``namespace``, ``cycler`` ...) as a
    plain dict: the output is what a fresh Jinja environment renders."""
    import jinja2

    files = {
        "t/v1/subject.txt": "{% for i in range(n) %}{{ i }}{% endfor %} {{ name }}",
        "t/v1/text.txt": "{% set ns = namespace(total=0) %}{% for i in range(n) %}"
        "{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }} {{ name }}",
        "t/v1/html.html": "{% set c = cycler('a', 'b') %}{% for i in range(n) %}"
        "{{ c.next() }}{% endfor %}<b>{{ name }}</b>",
    }
    _write(tmp_path, files)
    renderer = TemplateRenderer(tmp_path)
    for context in ({"n": 3, "name": "<Jane>"}, {"n": 5, "name": "Joe & co"}):
        mail = renderer.render("t", 1, context)
        text_env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        html_env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=True)
        expected = (
            text_env.from_string(files["t/v1/subject.txt"]).render(context).strip(),
            text_env.from_string(files["t/v1/text.txt"]).render(context),
            html_env.from_string(files["t/v1/html.html"]).render(context),
        )
        assert (mail.subject, mail.text, mail.html) == expected
    assert mail.subject == "01234 Joe & co" and mail.html == "ababa<b>Joe &amp; co</b>"
