"""Declared event schemas: checked at ``publish()``, checked against the upcasters, exported.

A ``RouteTable`` declares a JSON Schema (draft 7) per ``(event_type, version)``. They are
compiled with ``fastjsonschema`` (one package, no dependencies of its own: the producer's
install stays small) into plain Python functions, once per distinct schema and process, then
cached on the table: a publish pays a dict lookup and the check itself (~18 us for the demo's
receipt).

A table is checked as a whole the first time it is used (``prepared``): every schema compiles,
every ``examples`` entry matches its own schema, every routed version has a schema, and every
upcaster turns each example of its version into a payload the next version's schema accepts.
A table that fails is a ``ConfigurationError``: every publish with it fails loudly, and
``email-platform schemas check`` lists the problems.
"""

import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import fastjsonschema

from email_platform.common.errors import (
    ConfigurationError,
    PayloadSchemaError,
    UndeclaredEventError,
)
from email_platform.mail.routes import EventSchema, RouteTable

DRAFT_07 = "http://json-schema.org/draft-07/schema#"
#: ``$schema`` values fastjsonschema implements; a newer draft's keywords would be ignored.
SUPPORTED_DRAFTS = frozenset(
    {
        "http://json-schema.org/draft-04/schema#",
        "http://json-schema.org/draft-06/schema#",
        DRAFT_07,
        "http://json-schema.org/draft-07/schema",
    }
)
Validator = Callable[[Any], Any]


@lru_cache(maxsize=512)
def _compile_text(text: str) -> Validator:
    # use_default=False: checking must never fill in a producer's payload.
    return fastjsonschema.compile(json.loads(text), use_default=False)


def compile_schema(event_type: str, version: int, schema: EventSchema) -> Validator:
    """The schema as a function that raises on a payload it refuses; a ``ConfigurationError``
    naming the event if the schema itself is not one fastjsonschema can compile."""
    where = f"the schema of {event_type} v{version}"
    if not isinstance(schema, Mapping):
        raise ConfigurationError(f"{where} is a {type(schema).__name__}, not a JSON object")
    draft = schema.get("$schema")
    if draft is not None and draft not in SUPPORTED_DRAFTS:
        raise ConfigurationError(
            f"{where} names $schema {draft!r}; drafts 4, 6 and 7 are supported ({DRAFT_07})"
        )
    try:
        return _compile_text(json.dumps(schema, sort_keys=True, allow_nan=False))
    except Exception as exc:  # fastjsonschema raises several kinds on a malformed schema
        raise ConfigurationError(f"{where} is not a valid JSON Schema: {exc}") from None


def problems(table: RouteTable) -> list[str]:
    """Everything wrong with ``table``'s schemas, one sentence each; empty when all is well
    (always, for a table that declares no schemas)."""
    if not table.declares_schemas:
        return []
    malformed = [
        f"schemas key {key!r} is not (event_type, version)"
        for key in table.schemas
        if not (
            isinstance(key, tuple)
            and len(key) == 2
            and isinstance(key[0], str)
            and isinstance(key[1], int)
            and not isinstance(key[1], bool)
        )
    ]
    if malformed:
        return malformed
    found: list[str] = []
    validators: dict[tuple[str, int], Validator] = {}
    for (event_type, version), schema in sorted(table.schemas.items()):
        try:
            validators[event_type, version] = compile_schema(event_type, version, schema)
        except ConfigurationError as exc:
            found.append(str(exc))
            continue
        for i, example in enumerate(_examples(schema)):
            error = mismatch(validators[event_type, version], example, f"examples[{i}]")
            if error:
                found.append(f"{event_type} v{version}: {error[0]} {error[1]}")
    for key in sorted({(r.event_type, r.event_version) for r in table.routes}):
        if key not in table.schemas:
            found.append(f"{key[0]} v{key[1]} is routed but has no schema")
    for event_type, version in sorted(table.upcasters):
        found.extend(_upcaster_problems(table, validators, event_type, version))
    return found


def _upcaster_problems(
    table: RouteTable,
    validators: Mapping[tuple[str, int], Validator],
    event_type: str,
    version: int,
) -> list[str]:
    name = f"the upcaster of {event_type} v{version} to v{version + 1}"
    source, target = (event_type, version), (event_type, version + 1)
    missing = [f"v{v}" for _, v in (source, target) if (event_type, v) not in table.schemas]
    if missing:
        return [f"{name} connects no declared schema for {' and '.join(missing)}"]
    if source not in validators or target not in validators:
        return []  # the schema that does not compile is already reported
    examples = _examples(table.schemas[source])
    if not examples:
        return [f"{name} cannot be checked: the v{version} schema has no examples"]
    found: list[str] = []
    for i, example in enumerate(examples):
        try:
            upcast = table.upcasters[source](json.loads(json.dumps(example)))
        except Exception as exc:  # the upcaster's own failure, on a payload its schema allows
            found.append(f"{name} fails on examples[{i}]: {type(exc).__name__}: {exc}")
            continue
        error = mismatch(validators[target], upcast, "payload")
        if error:
            found.append(
                f"{name} turns examples[{i}] into a payload the v{version + 1} schema refuses: "
                f"{error[0]} {error[1]}"
            )
    return found


def _examples(schema: EventSchema) -> list[Any]:
    examples = schema.get("examples") if isinstance(schema, Mapping) else None
    return list(examples) if isinstance(examples, list) else []


def prepared(table: RouteTable) -> dict[tuple[str, int], Validator]:
    """``table``'s validators, checked as a whole on first use and cached on the table; a
    ``ConfigurationError`` listing the problems if the check fails."""
    # Rechecked when a schema is added, removed or replaced after first use.
    current = {key: id(schema) for key, schema in table.schemas.items()}
    state = table._compiled.get("state")
    if state is None or state[0] != current:
        found = problems(table)
        if found:
            raise ConfigurationError(
                "the route table's event schemas do not hold (`email-platform schemas check` "
                "lists them): " + "; ".join(found)
            )
        validators = {key: compile_schema(*key, schema) for key, schema in table.schemas.items()}
        state = (current, validators)
        table._compiled["state"] = state  # one assignment: a concurrent publish sees old or new
    return state[1]


def check_payload(
    table: RouteTable,
    event_type: str,
    version: int,
    payload: Any,
    *,
    field: str = "payload",
    after: str | None = None,
) -> None:
    """Refuse ``payload`` unless it matches the schema of ``event_type`` ``version``.

    A table without schemas lets everything through (as before schemas existed). ``after``
    says the payload is an upcaster's output, so the message blames the right party.
    """
    if not table.declares_schemas:
        return
    validator = prepared(table).get((event_type, version))
    if validator is None:
        declared = table.schema_versions(event_type)
        if after is not None:
            return  # the routed version without a schema is a table problem, reported above
        if declared:
            raise UndeclaredEventError(
                "event_version",
                f"{event_type} v{version} has no schema; the route table declares "
                f"{', '.join(f'v{v}' for v in declared)}",
                declared_versions=declared,
            )
        raise UndeclaredEventError(
            "event_type",
            f"{event_type!r} has no schema in the route table, which declares its events' "
            "schemas (docs/schemas.md)",
            declared_versions=(),
        )
    error = mismatch(validator, payload, field)
    if error is not None:
        name, message, rule = error[0], error[1], error[2]
        if after is not None:
            message = f"{message} ({after})"
        raise PayloadSchemaError(
            name,
            f"{message} (schema of {event_type} v{version})",
            event_type=event_type,
            event_version=version,
            rule=rule,
        )


def mismatch(validator: Validator, value: Any, root: str) -> tuple[str, str, str] | None:
    """``(field, message, rule)`` of the first thing ``value`` breaks, or None. The field is
    the value's path under ``root`` (``payload.items[1].quantity``); a missing required
    property is named itself (``payload.order_id``), not its parent."""
    try:
        validator(value)
    except fastjsonschema.JsonSchemaValueException as exc:
        path = root + (exc.name or "data").removeprefix("data")
        rule = exc.rule or "schema"
        if rule == "required" and isinstance(exc.value, Mapping):
            missing = [k for k in exc.rule_definition or () if k not in exc.value]
            if missing:
                return f"{path}.{missing[0]}", "is required", rule
        said = (exc.message or "").removeprefix(exc.name or "data").strip()
        return path, said or f"breaks the schema's {rule!r}", rule
    return None


def export(table: RouteTable) -> dict[str, dict[str, Any]]:
    """Every declared schema, by file name (``user.signed_up.v2.schema.json``), each with
    ``$schema``, ``$id``, a title and which version the table routes, for producers in other
    languages; plus ``index.json``."""
    problems_found = problems(table)
    if problems_found:
        raise ConfigurationError("; ".join(problems_found))
    files: dict[str, dict[str, Any]] = {}
    index: list[dict[str, Any]] = []
    for (event_type, version), schema in sorted(table.schemas.items()):
        name = f"{event_type}.v{version}.schema.json"
        current = table.default_version(event_type)
        document = {
            "$schema": DRAFT_07,
            "$id": name,
            "title": f"{event_type} v{version}",
            **dict(schema),
        }
        files[name] = document
        index.append(
            {
                "event_type": event_type,
                "event_version": version,
                "file": name,
                "current": version == current,
                "routed": bool(table.for_event(event_type, version)),
            }
        )
    files["index.json"] = {"schemas": index}
    return files


def write(table: RouteTable, out: Path) -> list[Path]:
    """``export(table)`` written into ``out`` (created if need be); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, document in export(table).items():
        path = out / name
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
