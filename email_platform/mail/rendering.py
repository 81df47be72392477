"""Template rendering: Jinja2 in strict-undefined mode, versioned templates, cached.

Layout: ``templates/<name>/v<version>/{subject.txt,text.txt,html.html}``, and per locale
``templates/<name>/v<version>/<locale>/`` with the same files (``mail.locales``: the first of
``pt-BR`` -> ``pt`` -> the unlocalized files that exists is used). A missing variable,
a syntax error or a subject with a line break is a ``TemplateRenderError`` (permanent: no retry
will fix it; a template fix plus a replay will).
"""

import re
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import jinja2

from email_platform.common.errors import TemplateRenderError
from email_platform.common.text import text_problem
from email_platform.mail import locales
from email_platform.mail.headers import unsafe_header_reason

PACKAGE_TEMPLATES = Path(__file__).parents[1] / "templates"
_VERSION_DIR = re.compile(r"^v(\d+)$")


@dataclass(frozen=True)
class _Compiled:
    """One template version, loaded: what ``render`` needs without touching the disk."""

    subject: jinja2.Template
    text: jinja2.Template
    html: jinja2.Template | None


@dataclass(frozen=True)
class RenderedEmail:
    subject: str
    text: str
    html: str | None
    template: str
    template_version: int
    #: The locale whose files rendered it (after fallback); None for the unlocalized ones.
    locale: str | None = None


class TemplateRenderer:
    """Renders a template version with a payload. Compiled templates are cached per instance.

    A version, once loaded, is kept with its three parts: a batch renders the same few versions
    thousands of times, and asking Jinja for each part again cost three ``stat`` calls (its
    auto-reload check) plus one for the optional HTML part, per message. The routing resource
    makes one instance per send step, so an edited template is picked up by the next step.
    """

    def __init__(self, directory: Path | str = PACKAGE_TEMPLATES) -> None:
        self.directory = Path(directory)
        loader = jinja2.FileSystemLoader(str(self.directory))
        self._text_env = jinja2.Environment(
            loader=loader,
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=False,
        )
        self._html_env = jinja2.Environment(
            loader=loader,
            undefined=jinja2.StrictUndefined,
            autoescape=True,
        )
        self._latest = cache(self._find_latest_version)
        self._compiled: dict[tuple[str, int, str | None], _Compiled] = {}
        # Keyed by the producers' tags: bounded, so endless distinct tags cannot grow it.
        self._locales = lru_cache(maxsize=1024)(self._find_locale)

    def _find_latest_version(self, template: str) -> int:
        root = self.directory / template
        versions = [
            int(m.group(1))
            for p in (root.iterdir() if root.is_dir() else [])
            if (m := _VERSION_DIR.match(p.name))
        ]
        if not versions:
            raise TemplateRenderError(
                f"template {template!r} does not exist", code="template_missing"
            )
        return max(versions)

    def latest_version(self, template: str) -> int:
        return self._latest(template)

    def _find_locale(self, template: str, version: int, tag: str | None) -> str | None:
        # Normalized again: a tag from anywhere never names a path outside the version.
        for candidate in locales.fallback_chain(locales.normalize(tag) if tag else None):
            if (self.directory / template / f"v{version}" / candidate / "subject.txt").is_file():
                return candidate
        return None

    def resolve_locale(self, template: str, version: int, tag: str | None) -> str | None:
        """The locale of ``tag``'s fallback chain that ``template`` v``version`` has files
        for, or None for the unlocalized files (``tag`` is a normalized tag or None)."""
        return self._locales(template, version, tag)

    def render(
        self,
        template: str,
        version: int | None,
        context: dict[str, Any],
        locale: str | None = None,
    ) -> RenderedEmail:
        version = version or self.latest_version(template)
        # A locale is a directory of its own complete files: no part falls back alone, so one
        # mail never mixes two languages.
        used = self.resolve_locale(template, version, locale) if locale else None
        base = f"{template}/v{version}" + (f"/{used}" if used else "")
        try:
            compiled = self._compiled.get((template, version, used)) or self._load(
                template, version, used
            )
            subject = compiled.subject.render(context).strip()
            text = compiled.text.render(context)
            html = compiled.html.render(context) if compiled.html is not None else None
        except jinja2.TemplateNotFound as exc:
            raise TemplateRenderError(
                f"{base}: missing {exc.name}", code="template_missing"
            ) from exc
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(f"{base}: {exc}", code="template_error") from exc
        except (TypeError, ValueError) as exc:
            raise TemplateRenderError(f"{base}: {exc}", code="template_error") from exc
        header_problem = unsafe_header_reason(subject)
        if header_problem is not None:
            raise TemplateRenderError(
                f"{base}: rendered subject {header_problem}", code="header_injection"
            )
        for part, rendered in (("subject", subject), ("text", text), ("html", html)):
            problem = text_problem(rendered) if rendered is not None else None
            if problem is not None:
                raise TemplateRenderError(
                    f"{base}: rendered {part} {problem}", code="unencodable_text"
                )
        return RenderedEmail(
            subject=subject,
            text=text,
            html=html,
            template=template,
            template_version=version,
            locale=used,
        )

    def _load(self, template: str, version: int, locale: str | None = None) -> _Compiled:
        """Compile one version's parts; raises Jinja's errors (nothing is cached on failure)."""
        base = f"{template}/v{version}" + (f"/{locale}" if locale else "")
        html_path = self.directory / base / "html.html"
        compiled = _Compiled(
            subject=_flat_globals(self._text_env.get_template(f"{base}/subject.txt")),
            text=_flat_globals(self._text_env.get_template(f"{base}/text.txt")),
            html=_flat_globals(self._html_env.get_template(f"{base}/html.html"))
            if html_path.exists()
            else None,
        )
        self._compiled[(template, version, locale)] = compiled
        return compiled


def _flat_globals(template: jinja2.Template) -> jinja2.Template:
    """``template`` with its globals (a ``ChainMap`` over the environment's) as one plain dict.

    Each render copies the globals into a new context and takes their names as a set; over a
    ``ChainMap`` that cost more than rendering a short template itself (bench/README.md). The
    environments here are the renderer's own and their globals never change after loading.
    """
    template.globals = dict(template.globals)
    return template
