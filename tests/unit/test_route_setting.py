"""One route table, named once: ``EMAIL_PLATFORM_ROUTES`` is read by ``publish()`` and by the
worker's routing resource alike, and unset it is a configuration error naming the setting, never
a silent fall back to the demo's routes. The demo, the stack, the bench and these tests choose
the demo's table explicitly (tests/conftest.py sets it for the whole run)."""

import dataclasses
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from email_platform import cli, publish, publish_many
from email_platform.common.config import ROUTES_SETTING
from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import Lane
from email_platform.db.schema import metadata
from email_platform.local.stack import StackSettings, stack_env
from email_platform.mail.routes import (
    DEMO_ROUTES,
    DEMO_TEMPLATES,
    Route,
    RouteTable,
    configured_routes,
    demo_routes,
    load_routes,
)
from email_platform.resources import RoutingResource
from email_platform.sending.batch import build_sender

#: A product's own table, as a module attribute (``tests.unit.test_route_setting:ORDERS``).
ORDERS = RouteTable(
    routes=[
        Route(
            name="shipped",
            event_type="order.shipped",
            event_version=1,
            template="shipped",
            lane=Lane.TRANSACTIONAL,
        )
    ],
    templates_dir="/srv/mail/templates",
)
SPEC = "tests.unit.test_route_setting:ORDERS"


def orders() -> RouteTable:
    """The same table from a function, the other form the setting accepts."""
    return ORDERS


NOT_A_TABLE = {"routes": []}


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROUTES_SETTING, raising=False)


def _sqlite():  # type: ignore[no-untyped-def]
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    return engine


@pytest.mark.usefixtures("unset")
def test_unset_publish_and_the_worker_both_name_the_setting() -> None:
    engine = _sqlite()
    payload = {"user_id": "u1", "email": "a@example.com", "first_name": "Jo"}
    with engine.begin() as connection, pytest.raises(ConfigurationError, match=ROUTES_SETTING):
        publish(connection, event_type="user.signed_up", aggregate_id="u1", payload=payload)
    with engine.begin() as connection, pytest.raises(ConfigurationError, match=ROUTES_SETTING):
        publish_many(connection, [{"event_type": "x", "aggregate_id": "a", "payload": {}}])
    with pytest.raises(ConfigurationError, match=ROUTES_SETTING):
        RoutingResource().route_table()
    with pytest.raises(ConfigurationError, match=ROUTES_SETTING):
        build_sender(engine=engine, provider=None, lane=None, sender_address="a@example.com")  # type: ignore[arg-type]
    # The error says how to choose the demo's table on purpose.
    with pytest.raises(ConfigurationError, match=DEMO_ROUTES):
        configured_routes()


@pytest.mark.parametrize("spec", [SPEC, "tests.unit.test_route_setting:orders"])
def test_publish_and_the_worker_read_the_same_table(
    monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    monkeypatch.setenv(ROUTES_SETTING, spec)
    assert configured_routes() is ORDERS
    assert RoutingResource().route_table() is ORDERS
    # The table names its templates; the resource's own setting overrides them.
    assert RoutingResource().renderer().directory == Path("/srv/mail/templates")
    assert RoutingResource(templates_dir="/elsewhere").renderer().directory == Path("/elsewhere")
    engine = _sqlite()
    with engine.begin() as connection:
        event_id = publish(
            connection,
            event_type="order.shipped",
            aggregate_id="o1",
            payload={"email": "a@example.com"},
        )
        lane = connection.exec_driver_sql(
            "SELECT lane FROM email_outbox WHERE event_id = ?", (event_id,)
        ).scalar_one()
    assert lane == "transactional"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_colon", "expected 'package.module:NAME'"),
        ("no.such.module:ROUTES", "No module named"),
        ("tests.unit.test_route_setting:MISSING", "MISSING"),
        ("tests.unit.test_route_setting:NOT_A_TABLE", "not a RouteTable"),
    ],
)
def test_a_wrong_setting_is_a_configuration_error_naming_it(spec: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=ROUTES_SETTING) as raised:
        load_routes(spec)
    assert says in str(raised.value)


#: A table that names no templates folder.
BARE = dataclasses.replace(ORDERS, templates_dir=None)


def test_a_table_without_templates_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="templates_dir"):
        RoutingResource(routes_factory="tests.unit.test_route_setting:BARE").renderer()
    assert (
        RoutingResource(routes_factory="tests.unit.test_route_setting:BARE").route_table() is BARE
    )


def test_the_demo_table_is_chosen_by_name_and_brings_its_templates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ROUTES_SETTING, DEMO_ROUTES)
    table = configured_routes()
    assert [r.name for r in table.routes] == [r.name for r in demo_routes().routes]
    assert RoutingResource().renderer().directory == DEMO_TEMPLATES
    # The local stack (the bench's) names it for every process it starts.
    assert stack_env(StackSettings(tmp_path))[ROUTES_SETTING] == DEMO_ROUTES
    assert table.route("welcome").template == "welcome"
    with pytest.raises(KeyError, match="no route 'nope'"):
        table.route("nope")


@pytest.mark.usefixtures("unset")
def test_the_command_line_names_the_setting_instead_of_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from email_platform.db.engine import make_engine, upgrade

    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    upgrade(make_engine(url))
    with pytest.raises(SystemExit) as exited:
        cli.run(["erase", "--aggregate-id", "u1", "--url", url])
    assert exited.value.code == 2
    assert ROUTES_SETTING in capsys.readouterr().err


def test_a_missing_extra_is_named_instead_of_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The producer's install has no click: the command line's modules cannot be imported.
    for name in [m for m in sys.modules if m.startswith("email_platform.cli.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "click", None)
    with pytest.raises(SystemExit) as exited:
        cli.run(["--help"])
    assert exited.value.code == 3
    assert "pip install 'email-platform[dagster]'" in capsys.readouterr().err
