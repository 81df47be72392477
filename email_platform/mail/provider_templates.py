"""Provider-hosted templates: a route that names a template kept at the provider (Postmark's
``TemplateAlias``, a SendGrid dynamic template, a Mailgun or SES template, a Resend template)
and the variables it takes from the payload, instead of a local Jinja template.

No local rendering happens for such a route: the message carries a ``ProviderTemplateCall``
(id, version, variables) and the adapter asks the provider to render (``providers/templated``).
The message row records ``template`` = the provider template's id and ``template_version`` =
the version pinned, or ``LIVE_VERSION`` (0) for "whatever version the provider has live", so
the funnel and ``trace`` show it as they show local templates (docs/provider-templates.md).
Through a provider without templates (SMTP) the route's own ``template``, when it names a local
one, is rendered and recorded instead; without one, the sender refuses to start.

Variables come from the producer, so ``publish()`` checks them (``check_payload``): every named
field present, the whole JSON-serializable, at most ``MAX_VARIABLES_BYTES`` and
``MAX_VARIABLES_DEPTH`` deep, its text storable; a refusal is an ``InvalidPayloadError`` naming
the field.
"""

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from email_platform.common.errors import InvalidPayloadError, TemplateRenderError
from email_platform.common.text import text_problem

if TYPE_CHECKING:
    from email_platform.mail.rendering import RenderedEmail

#: ``template_version`` recorded when the route pins none: the provider's live version.
LIVE_VERSION = 0
#: Bounds on one message's variables, JSON-encoded (SES takes 256 KiB, SendGrid's whole
#: request 20 MB; 32 KiB keeps every provider's form and header limits far away).
MAX_VARIABLES_BYTES = 32 * 1024
#: Nesting of objects and lists below the variables object itself.
MAX_VARIABLES_DEPTH = 8
#: What a template id may hold: it is recorded in ``email_messages.template`` (100 characters)
#: and sent in JSON bodies, form fields and URL-free places only.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,99}")
#: A version tag (Mailgun's ``t:version``) ends in the number the message records: ``v3``.
_VERSION_TAG = re.compile(r"[A-Za-z0-9_.-]{0,40}?(\d{1,9})")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")

#: A function from the (upcast) payload to the variables: rename, reshape, compute.
VariablesFunction = Callable[[Mapping[str, Any]], Mapping[str, Any]]


@dataclass(frozen=True)
class ProviderTemplateCall:
    """What an adapter sends for one message: the template, the version, its variables
    (a JSON object, already checked)."""

    id: str
    #: None: the provider's live version; else what the route pinned (an int, or a tag).
    version: int | str | None
    variables: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProviderTemplate:
    """A template kept at the provider, named by a route (``Route.provider_template``).

    ``id``: the provider's template id or alias (Postmark: an alias, or digits for a numeric
    ``TemplateId``; SendGrid: ``d-…``; Mailgun, SES: the template's name; Resend: id or alias).
    ``version``: None for the provider's live version, or a pinned one (an int, or a tag such as
    Mailgun's ``v3`` ending in its number); only the sandbox and Mailgun can pin one.
    ``variables``: the payload fields passed as they are, or a function of the payload.
    """

    id: str
    version: int | str | None = None
    variables: tuple[str, ...] | VariablesFunction = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.fullmatch(self.id):
            raise ValueError(
                f"provider template id {self.id!r}: 1 to 100 of A-Z a-z 0-9 _ . : / - "
                "(starting with a letter or digit)"
            )
        version = self.version
        if isinstance(version, bool) or not (
            version is None
            or (isinstance(version, int) and 1 <= version < 10**9)
            or (isinstance(version, str) and _VERSION_TAG.fullmatch(version))
        ):
            raise ValueError(
                f"provider template {self.id}: version {version!r} is not None, a positive "
                "integer or a tag ending in its number (v3)"
            )
        if not callable(self.variables):
            names = tuple(self.variables)
            bad = [n for n in names if not isinstance(n, str) or not _FIELD.fullmatch(n)]
            if bad:
                raise ValueError(f"provider template {self.id}: {bad!r} are not field names")
            object.__setattr__(self, "variables", names)

    @property
    def recorded_version(self) -> int:
        """The ``template_version`` a message records: the pinned number, else 0 (live)."""
        if self.version is None:
            return LIVE_VERSION
        if isinstance(self.version, int):
            return self.version
        match = _VERSION_TAG.fullmatch(self.version)
        assert match is not None  # checked in __post_init__
        return int(match.group(1))

    def template_name(self, route: str, template: str, pinned: int | None) -> str:
        """A route's ``template`` beside this one: its local fallback, else the id. A route
        pins its provider template's version here, not in ``template_version``."""
        if pinned is not None:
            raise ValueError(
                f"route {route}: pin a provider template's version in ProviderTemplate(version=…)"
                ", not in Route(template_version=…)"
            )
        return template or self.id

    def variables_for(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The variables of one message; ``KeyError`` names a field the payload lacks."""
        if callable(self.variables):
            made = self.variables(payload)
            if not isinstance(made, Mapping):
                raise TypeError(f"the variables function returned a {type(made).__name__}")
            return dict(made)
        return {name: payload[name] for name in self.variables}

    def check_payload(self, route: str, payload: Mapping[str, Any]) -> None:
        """``publish()``'s check: the variables this payload gives can be sent, or an
        ``InvalidPayloadError`` naming the field."""
        where = f"route {route}'s provider template {self.id}"
        if not callable(self.variables):
            for name in self.variables:
                if name not in payload:
                    raise InvalidPayloadError(f"payload.{name}", f"is required by {where}")
        try:
            variables = self.variables_for(payload)
        except Exception as exc:  # a function that cannot read this payload would fail later
            raise InvalidPayloadError(
                "payload", f"{where}: the variables function failed: {type(exc).__name__}: {exc}"
            ) from None
        field_of = (
            (lambda key: f"payload.{key}")
            if not callable(self.variables)
            else (lambda key: f"payload ({where}'s variable {key})")
        )
        problem = variables_problem(variables)
        if problem is not None:
            key, message = problem
            raise InvalidPayloadError(field_of(key) if key else "payload", f"{message} ({where})")

    def call(self, payload: Mapping[str, Any]) -> ProviderTemplateCall:
        """What the adapter sends for this payload (send time; publish checked it). A payload
        published before the route changed may fail here: a permanent, named error."""
        try:
            variables = self.variables_for(payload)
        except Exception as exc:  # a field gone, a function that cannot read this payload
            raise TemplateRenderError(
                f"provider template {self.id}: variables: {type(exc).__name__}: {exc}",
                code="template_variables",
            ) from None
        problem = variables_problem(variables)
        if problem is not None:
            raise TemplateRenderError(
                f"provider template {self.id}: variable {problem[0] or '(all)'} {problem[1]}",
                code="template_variables",
            )
        # A JSON round trip: the adapters get plain dicts, lists, str, int, float, bool, None.
        return ProviderTemplateCall(self.id, self.version, json.loads(json.dumps(variables)))


def variables_problem(variables: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why ``variables`` cannot be sent: (the top-level key at fault or "", the reason)."""
    for key in variables:
        if not isinstance(key, str) or not key or text_problem(key) is not None:
            return "", f"has a key {key!r} that is not a non-empty string of text"
    for key, value in variables.items():
        reason = _value_problem(value)
        if reason is not None:
            return key, reason
    try:
        encoded = json.dumps(dict(variables), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        return "", f"is not JSON-serializable: {exc}"
    size = len(encoded.encode())
    if size > MAX_VARIABLES_BYTES:
        return "", f"the variables are {size} bytes; the limit is {MAX_VARIABLES_BYTES}"
    return None


def _value_problem(root: Any) -> str | None:
    """Depth, types and text of one variable's value, without recursion (a hostile tree is
    deep)."""
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node)
            if problem is not None:
                return problem
        elif isinstance(node, Mapping | list | tuple):
            if depth >= MAX_VARIABLES_DEPTH:
                return f"nests deeper than {MAX_VARIABLES_DEPTH} levels"
            if isinstance(node, Mapping):
                for key, item in node.items():
                    if not isinstance(key, str) or text_problem(key) is not None:
                        return f"has a key {key!r} that is not text"
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, float):
            if node != node or node in (float("inf"), float("-inf")):
                return "holds a number JSON cannot carry (NaN or infinity)"
        elif not (node is None or isinstance(node, bool | int)):
            return f"holds a {type(node).__name__}, which JSON cannot carry"
    return None


def stand_in(template: str, version: int) -> "RenderedEmail":
    """What the send path holds instead of a rendering: the provider renders subject and body."""
    # Imported here: publish() loads this module (through routes), and Jinja, which rendering
    # needs, is not a dependency of the producer's core.
    from email_platform.mail.rendering import RenderedEmail

    return RenderedEmail(
        subject="", text="", html=None, template=template, template_version=version
    )
