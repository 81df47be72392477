"""Declared event schemas without a database: the table check, the field a mismatch names, the
upcaster check, the export and the ``email-platform schemas`` commands."""

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from email_platform.cli.app import main
from email_platform.common.errors import ConfigurationError
from email_platform.mail.routes import DEMO_ROUTES, DEMO_SCHEMAS, RouteTable, demo_routes
from email_platform.publishing import schemas

V1 = ("user.signed_up", 1)
V2 = ("user.signed_up", 2)


def _validator(key: tuple[str, int]) -> Any:
    return schemas.compile_schema(*key, DEMO_SCHEMAS[key])


def test_the_demo_declares_every_routed_version_and_its_schemas_hold() -> None:
    table = demo_routes()
    routed = {(r.event_type, r.event_version) for r in table.routes}
    assert routed <= set(table.schemas)
    assert ("cart.viewed", 1) in table.schemas  # declared, routed nowhere
    assert schemas.problems(table) == []


@pytest.mark.parametrize(
    ("payload", "field", "rule"),
    [
        ({"email": "a@example.com"}, "payload.order_id", "required"),
        ({"email": "a@example.com", "order_id": 1.5}, "payload.order_id", "type"),
        (
            {"email": "a@example.com", "order_id": "o", "items": [{"name": "m"}]},
            "payload.items[0].quantity",
            "required",
        ),
        (
            {
                "email": "a@example.com",
                "order_id": "o",
                "items": [{"name": "m", "quantity": 0, "unit_price": 1}],
            },
            "payload.items[0].quantity",
            "minimum",
        ),
        ({"email": "a@example.com", "order_id": "o", "currency": "eur"}, "payload.currency", None),
        ([], "payload", "type"),
    ],
)
def test_a_mismatch_names_the_field(payload: Any, field: str, rule: str | None) -> None:
    found = schemas.mismatch(_validator(("order.paid", 1)), payload, "payload")
    assert found is not None
    assert found[0] == field
    if rule is not None:
        assert found[2] == rule


def test_a_valid_payload_matches() -> None:
    example = DEMO_SCHEMAS[("order.paid", 1)]["examples"][0]
    assert schemas.mismatch(_validator(("order.paid", 1)), example, "payload") is None


def test_an_upcaster_whose_output_breaks_the_next_schema_is_a_problem() -> None:
    table = demo_routes()
    table.upcasters[V1] = lambda payload: {"user_id": payload["user_id"]}  # drops the email
    found = schemas.problems(table)
    assert len(found) == 1
    assert "upcaster of user.signed_up v1 to v2" in found[0]
    assert "payload.email" in found[0]
    with pytest.raises(ConfigurationError, match=r"payload\.email"):
        schemas.prepared(table)


def test_an_upcaster_that_raises_or_connects_undeclared_versions_is_a_problem() -> None:
    table = demo_routes()
    table.upcasters[V1] = lambda payload: payload["missing"]
    table.upcasters[("order.paid", 1)] = lambda payload: payload
    found = schemas.problems(table)
    assert any("fails on examples[0]: KeyError" in p for p in found), found
    assert any("order.paid v1 to v2 connects no declared schema for v2" in p for p in found)


def test_an_upcaster_without_examples_to_try_is_a_problem() -> None:
    table = demo_routes()
    table.schemas[V1] = {k: v for k, v in DEMO_SCHEMAS[V1].items() if k != "examples"}
    assert schemas.problems(table) == [
        "the upcaster of user.signed_up v1 to v2 cannot be checked: the v1 schema has no examples"
    ]


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ({"type": "nope"}, "not a valid JSON Schema"),
        ({"$schema": "https://json-schema.org/draft/2020-12/schema"}, "drafts 4, 6 and 7"),
        ({"type": "object", "examples": [{}], "required": ["a"]}, "examples[0]"),
    ],
)
def test_a_bad_schema_or_example_is_a_problem(schema: dict[str, Any], said: str) -> None:
    table = demo_routes()
    table.schemas[("digest.ready", 1)] = schema
    found = schemas.problems(table)
    assert any(said in p for p in found), found


def test_a_routed_version_without_a_schema_is_a_problem_of_a_strict_table() -> None:
    table = demo_routes()
    del table.schemas[("digest.ready", 1)]
    assert schemas.problems(table) == ["digest.ready v1 is routed but has no schema"]
    assert schemas.problems(RouteTable(routes=table.routes)) == []  # declares none: lenient


@settings(max_examples=200, deadline=None)
@given(
    user_id=st.text(min_size=1, max_size=200),
    email=st.text(max_size=40),
    name=st.one_of(st.none(), st.text(max_size=200)),
    extra=st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=10), max_size=3),
)
def test_any_valid_v1_payload_upcasts_to_a_valid_v2_payload(
    user_id: str, email: str, name: str | None, extra: dict[str, Any]
) -> None:
    """The property behind the example check: every v1 payload its schema accepts, upcast by
    the demo's upcaster, is one the v2 schema accepts."""
    payload: dict[str, Any] = {**extra, "user_id": user_id, "email": email}
    if name is not None:
        payload["name"] = name
    v1, v2 = _validator(V1), _validator(V2)
    if schemas.mismatch(v1, payload, "payload") is not None:
        return  # not a valid v1 payload (an extra key named like a declared field)
    upcast = demo_routes().upcasters[V1](dict(payload))
    assert schemas.mismatch(v2, upcast, "payload") is None, upcast


def test_export_writes_one_file_per_type_and_version(tmp_path: Path) -> None:
    written = schemas.write(demo_routes(), tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == sorted([f"{t}.v{v}.schema.json" for t, v in DEMO_SCHEMAS] + ["index.json"])
    v2 = json.loads((tmp_path / "out" / "user.signed_up.v2.schema.json").read_text())
    assert v2["$schema"] == schemas.DRAFT_07
    assert v2["required"] == ["user_id", "email"]
    index = json.loads((tmp_path / "out" / "index.json").read_text())["schemas"]
    signed_up = {e["event_version"]: e for e in index if e["event_type"] == "user.signed_up"}
    assert signed_up[1]["current"] is False and signed_up[2]["current"] is True
    # What was exported validates what the platform accepts, read back from the file alone.
    exported = schemas.compile_schema(*V2, v2)
    assert schemas.mismatch(exported, DEMO_SCHEMAS[V2]["examples"][0], "payload") is None


def test_the_cli_checks_and_exports(tmp_path: Path) -> None:
    runner = CliRunner()
    checked = runner.invoke(main, ["schemas", "check", "--routes", DEMO_ROUTES])
    assert checked.exit_code == 0, checked.output
    assert "7 schema(s) hold; 1 upcaster(s) checked" in checked.output
    exported = runner.invoke(main, ["schemas", "export", "--out", str(tmp_path)])
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "order.paid.v1.schema.json").exists()
    printed = runner.invoke(main, ["schemas", "export"])
    assert "user.signed_up.v1.schema.json" in json.loads(printed.output)


BROKEN = RouteTable(
    routes=demo_routes().routes,
    upcasters={V1: lambda payload: {}},
    schemas=dict(DEMO_SCHEMAS),
)


def test_the_cli_says_what_does_not_hold() -> None:
    runner = CliRunner()
    spec = f"{__name__}:BROKEN"
    checked = runner.invoke(main, ["schemas", "check", "--routes", spec])
    assert checked.exit_code == 1
    assert "problem: the upcaster of user.signed_up v1 to v2 turns examples[0]" in checked.output
    exported = runner.invoke(main, ["schemas", "export", "--routes", spec])
    assert exported.exit_code == 1
    assert "schemas check" in exported.output


def test_a_malformed_key_is_a_problem_and_a_used_table_still_pickles() -> None:
    import pickle

    table = demo_routes()
    schemas.prepared(table)  # compiled validators are cached on the table ...
    assert pickle.loads(pickle.dumps(table)).schemas == table.schemas  # ... and not pickled
    table.schemas[("digest.ready", "1")] = {}  # type: ignore[index]
    assert schemas.problems(table) == [
        "schemas key ('digest.ready', '1') is not (event_type, version)"
    ]
