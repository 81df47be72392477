"""Locales: which language a message is rendered in.

A route reads a locale from the payload (``Route.locale_field``) or asks a function
(``Route.locale_lookup``). The tag is a strict subset of BCP 47: a language (2-3 letters), an
optional script (4 letters) and an optional region (2 letters or 3 digits), separated by ``-``
or ``_``, in any case; it is normalized to ``pt-BR`` / ``zh-Hant-TW``. The templates used are
the first of the fallback chain that exists (``pt-BR`` -> ``pt`` -> the unlocalized default).

At ``publish()`` a payload locale that is not such a tag is refused (``InvalidLocaleError``
naming the field); an empty or absent one means the default. At send time (an event published
before the route read a locale, or a lookup's answer) anything not a tag means the default:
the mail can still go out, in the default language.
"""

import re
from collections.abc import Callable, Mapping
from typing import Any

from email_platform.common.errors import PublishError

#: The messages table's ``locale`` column length (BCP 47's recommended minimum buffer).
MAX_LENGTH = 35
_TAG = re.compile(r"([A-Za-z]{2,3})(?:[-_]([A-Za-z]{4}))?(?:[-_]([A-Za-z]{2}|[0-9]{3}))?", re.ASCII)

#: ``payload -> locale or None``: a route's lookup (a user's preference, say).
LocaleLookup = Callable[[Mapping[str, Any]], str | None]


class InvalidLocaleError(PublishError):
    """A payload's locale is not a language tag this platform takes (``pt-BR``, ``fr``)."""


def normalize(value: str) -> str | None:
    """The canonical form of a tag (``pt_br`` -> ``pt-BR``), or None if it is not one."""
    if not isinstance(value, str) or len(value) > MAX_LENGTH:
        return None
    match = _TAG.fullmatch(value)
    if match is None:
        return None
    language, script, region = match.groups()
    parts = [language.lower()]
    if script:
        parts.append(script.title())
    if region:
        parts.append(region.upper())
    return "-".join(parts)


def check_locale(field: str, value: Any) -> str | None:
    """``publish()``'s check: None or "" is the default; a tag is normalized; else refused."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidLocaleError(
            field, f"must be a language tag string, not {type(value).__name__}"
        )
    tag = normalize(value)
    if tag is None:
        raise InvalidLocaleError(
            field, "is not a language tag like 'pt-BR', 'pt' or 'zh-Hant-TW' (letters, '-' or '_')"
        )
    return tag


def fallback_chain(tag: str | None) -> list[str]:
    """The locales to try, most specific first: ``pt-BR`` -> ``["pt-BR", "pt"]``. The default
    (unlocalized templates) comes after them and is not listed."""
    if not tag:
        return []
    parts = tag.split("-")
    return ["-".join(parts[:n]) for n in range(len(parts), 0, -1)]


def requested(route: Any, payload: Mapping[str, Any]) -> str | None:
    """The locale ``route`` asks for with ``payload`` at send time, normalized; None for the
    default. A lookup that fails or answers something not a tag means the default too."""
    field = getattr(route, "locale_field", None)
    value: Any = payload.get(field) if field else None
    lookup: LocaleLookup | None = getattr(route, "locale_lookup", None)
    if not value and lookup is not None:
        try:
            value = lookup(payload)
        except Exception:  # a directory that cannot answer: the default language still sends
            value = None
    return normalize(value) if isinstance(value, str) else None


def used_for(renderer: Any, route: Any, payload: Mapping[str, Any], version: int) -> str | None:
    """The locale a new message of ``route`` records: what the payload asks for, after the
    fallback chain over the templates that exist; None for the default."""
    tag = requested(route, payload)
    if tag is None:
        return None
    try:
        return renderer.resolve_locale(route.template, version, tag)
    except OSError:  # an unreadable templates folder fails the render, with its reason
        return None
