"""The Dagster Component gives what build_definitions() gives, from a defs.yaml, and both merge
into a project's own definitions without a clash (docs/dagster-component.md)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import LaneConfig
from email_platform.component import (
    DEMO_ROUTES,
    EmailPlatformComponent,
    EmailPlatformScaffolder,
    LaneSettings,
    ScaffoldParams,
)
from email_platform.definitions import build_definitions
from email_platform.mail.routes import default_routes
from email_platform.resources import RoutingResource

#: A route table named as an object ("module:ROUTES"), as a product would.
ROUTES = default_routes()


def _shape(defs: dg.Definitions) -> dict:
    repository = defs.get_repository_def()
    graph = repository.asset_graph
    return {
        "jobs": sorted(job.name for job in repository.get_all_jobs()),
        "sensors": sorted(sensor.name for sensor in repository.sensor_defs),
        "schedules": sorted(schedule.name for schedule in repository.schedule_defs),
        "assets": sorted(
            key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()
        ),
        "checks": len(graph.asset_check_keys),
        "resources": sorted(repository.get_top_level_resources()),
    }


def test_the_component_gives_what_build_definitions_gives():
    component = EmailPlatformComponent.from_attributes_dict(attributes={"routes": DEMO_ROUTES})
    assert _shape(dg.component_defs(component=component)) == _shape(build_definitions())


def test_a_scaffolded_defs_yaml_reads_the_environment_and_sets_every_resource(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    EmailPlatformScaffolder().scaffold(
        dg.ScaffoldRequest(
            type_name="email_platform.EmailPlatformComponent",
            target_path=tmp_path,
            scaffold_format="yaml",
            project_root=None,
            params=ScaffoldParams(routes="tests.unit.test_component:ROUTES", provider="postmark"),
        )
    )
    text = (tmp_path / "defs.yaml").read_text()
    text = text.replace("  # templates_dir: templates", "  templates_dir: templates")
    text = text.replace("    # api_key_env: POSTMARK_API_KEY", "    api_key_env: SHOP_POSTMARK_KEY")
    text = text.replace(
        "  # lanes:\n  #   bulk: {batch_size: 500, workers: 2}",
        "  lanes:\n    bulk: {batch_size: 500, workers: 2}",
    )
    (tmp_path / "defs.yaml").write_text(text)
    monkeypatch.setenv("DATABASE_URL", "postgresql://shop@db/shop")
    monkeypatch.setenv("SHOP_POSTMARK_KEY", "secret-token")

    monkeypatch.chdir(tmp_path)  # the test tree's project root
    context = dg.ComponentTree.for_test().load_context.for_path(tmp_path)
    (component,) = EmailPlatformComponent.from_yaml_path(tmp_path / "defs.yaml", context).components  # type: ignore[attr-defined]
    assert isinstance(component, EmailPlatformComponent)
    assert component.database_url == "postgresql://shop@db/shop"
    resources = component.resources(tmp_path)
    assert resources["email_database"].resolved_url() == "postgresql://shop@db/shop"
    # As a run initializes it: the key read from its variable then.
    provider = resources["email_provider"].process_config_and_initialize()
    assert provider.settings().name == "postmark" and provider.settings().api_key == "secret-token"
    assert resources["email_lanes"].config_for("bulk").batch_size == 500
    assert resources["email_lanes"].config_for("bulk").workers == 2
    routing = resources["email_routing"]
    assert routing.templates_dir == str((tmp_path / "templates").resolve())
    assert routing.route_table() is ROUTES


def test_the_api_key_is_read_in_the_run_and_shown_by_name(monkeypatch: pytest.MonkeyPatch):
    component = EmailPlatformComponent.from_attributes_dict(
        attributes={
            "routes": DEMO_ROUTES,
            "provider": {"name": "resend", "api_key_env": "SHOP_RESEND_KEY"},
        }
    )
    provider = component.resources(Path("."))["email_provider"]
    assert provider.api_key == dg.EnvVar("SHOP_RESEND_KEY")


@pytest.mark.parametrize(
    "attributes",
    [
        {"routes": "no_colon"},
        {"routes": DEMO_ROUTES, "provider": {"name": "carrier_pigeon"}},
        {"routes": DEMO_ROUTES, "lanes": {"urgent": {"batch_size": 1}}},
        {"routes": DEMO_ROUTES, "lanes": {"bulk": {"batch_sise": 1}}},
        {"routes": DEMO_ROUTES, "provider": {"name": "sandbox", "timeout_s": 0}},
        {"routes": DEMO_ROUTES, "provider": {"name": "sandbox", "timeout_s": 86400}},
    ],
)
def test_a_wrong_attribute_is_refused_when_the_definitions_load(attributes):
    with pytest.raises(Exception, match=r"routes|provider|lane|batch_sise|timeout_s"):
        EmailPlatformComponent.from_attributes_dict(attributes=attributes)


def test_without_routes_the_workers_read_the_setting_publish_reads(monkeypatch):
    component = EmailPlatformComponent.from_attributes_dict(attributes={})
    routing = component.resources(Path("."))["email_routing"]
    monkeypatch.setenv("EMAIL_PLATFORM_ROUTES", "tests.unit.test_component:ROUTES")
    assert routing.route_table() is ROUTES
    monkeypatch.delenv("EMAIL_PLATFORM_ROUTES")
    with pytest.raises(ConfigurationError, match="EMAIL_PLATFORM_ROUTES"):
        routing.route_table()


def test_lane_settings_name_every_setting_of_a_lane():
    shipped = {field.name for field in dataclasses.fields(LaneConfig)} - {"lane"}
    assert set(LaneSettings.model_fields) == shipped


def test_the_platform_merges_into_a_project_with_its_own_executor_loggers_and_resources():
    class Store(dg.ConfigurableResource):
        path: str = "shop"

    @dg.asset
    def email_funnel(warehouse: Store, database: Store) -> int:
        return 1

    @dg.logger
    def console(_context):  # type: ignore[no-untyped-def]
        import logging

        return logging.getLogger("shop")

    own = dg.Definitions(
        assets=[email_funnel],
        executor=dg.multiprocess_executor,
        loggers={"console": console},
        resources={"warehouse": Store(), "database": Store()},
    )
    merged = dg.Definitions.merge(build_definitions(), own)
    dg.Definitions.validate_loadable(merged)
    repository = merged.get_repository_def()
    # Each of our jobs keeps its own executor and logger; the project's are the default.
    assert repository.get_job("send_email_job").executor_def.name == "in_process"
    assert repository.get_job("email_analytics_job").executor_def.name == "in_process"
    assert repository.get_job("__ASSET_JOB").executor_def.name == "multiprocess"
    send_logger = repository.get_job("send_email_job").loggers["console"]
    assert send_logger is not console
    assert {"email_funnel", "email_platform/email_funnel"} <= {
        key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()
    }


def test_routes_name_a_table_or_a_function_returning_one():
    table = RoutingResource(routes_factory="tests.unit.test_component:ROUTES").route_table()
    assert table is ROUTES
    by_function = RoutingResource(routes_factory=DEMO_ROUTES).route_table()
    assert [route.name for route in by_function.routes] == [route.name for route in ROUTES.routes]


def test_the_package_names_the_component_and_a_producer_imports_no_dagster():
    import email_platform

    assert email_platform.EmailPlatformComponent is EmailPlatformComponent
    assert "EmailPlatformComponent" in dir(email_platform)
    script = "import sys, email_platform; print(json.dumps('dagster' in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", "import json; " + script],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout) is False
