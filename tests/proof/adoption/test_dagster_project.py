"""A new Dagster project adds email with Dagster's own tools, as a user would, offline.

``create-dagster project`` makes the project; ``dg list components`` finds
``email_platform.EmailPlatformComponent`` through this checkout's entry point;
``dg scaffold defs`` writes its ``defs.yaml``; the project keeps an asset and resources of its own
named as ours once were (``warehouse``, ``database``) and an executor of its own; ``dg check
defs`` loads it all; then one email goes through the project's own send job to the sandbox
provider, sent once. The current environment stands in for the project's virtualenv (nothing
is downloaded): this checkout's package metadata is prepared with the build backend, so the
entry point is the one ``pyproject.toml`` declares.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import email_outbox
from email_platform.sandbox.server import SandboxServer
from tests.paths import ROOT

BIN = Path(sys.executable).parent
PROJECT = "shop"

ROUTES_MODULE = '''
"""The shop's route table: one object, read by publish() and by the send jobs."""

from email_platform.common.lanes import Lane
from email_platform.mail.routes import Route, RouteTable

ROUTES = RouteTable(
    routes=[
        Route(
            name="order_shipped",
            event_type="order.shipped",
            event_version=1,
            template="order_shipped",
            lane=Lane.TRANSACTIONAL,
            header_fields=("order_id",),
        )
    ]
)
'''

# The shop's own definitions, with the names the platform's resources once had.
OWN_DEFS = """
import dagster as dg


class Warehouse(dg.ConfigurableResource):
    path: str = "shop.duckdb"


class Database(dg.ConfigurableResource):
    url: str = "sqlite://"


@dg.asset
def orders(warehouse: Warehouse, database: Database) -> int:
    return 1


defs = dg.Definitions(
    assets=[orders], resources={"warehouse": Warehouse(), "database": Database()}
)
"""

# The project's top level: its defs folder, and an executor of its own for every job that does
# not choose one (the merge failed with "both have an executor" before).
TOP_LEVEL = """
from pathlib import Path

import dagster as dg


@dg.definitions
def defs():
    return dg.Definitions.merge(
        dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
        dg.Definitions(executor=dg.multiprocess_executor),
    )
"""

# Run in the project's environment: load its definitions, validate them, send one event's mail
# with its send job in process, and say what the definitions hold.
SEND = """
import json, sys

import dagster as dg

from email_platform.jobs import send_run_config
from shop.definitions import defs

definitions = defs()
dg.Definitions.validate_loadable(definitions)
repository = definitions.get_repository_def()
job = repository.get_job("send_email_job")
result = job.execute_in_process(
    run_config=send_run_config("transactional", [sys.argv[1]]),
    instance=dg.DagsterInstance.ephemeral(),
)
graph = repository.asset_graph
keys = sorted(key.to_user_string() for key in graph.get_all_asset_keys())
groups = sorted({graph.get(key).group_name for key in graph.get_all_asset_keys()})
print(json.dumps({
    "success": result.success,
    "resources": sorted(repository.get_top_level_resources()),
    "assets": keys,
    "groups": groups,
    "send_executor": job.executor_def.name,
    "asset_job_executor": repository.get_job("__ASSET_JOB").executor_def.name,
}))
"""


def test_a_new_dagster_project_adds_email_with_dg_and_sends_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    metadata = _checkout_metadata(tmp_path)
    project = tmp_path / PROJECT
    database_url = f"sqlite:///{tmp_path / 'shop.sqlite3'}"

    with SandboxServer() as sandbox_url:
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "DAGSTER_DG_UPDATE_CHECK_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join(map(str, [metadata, ROOT, project / "src"])),
            # What defs.yaml reads through Dagster's templating.
            "DATABASE_URL": database_url,
            "SANDBOX_URL": sandbox_url,
            # The one route table, read by publish() and by the Component's workers alike.
            "EMAIL_PLATFORM_ROUTES": f"{PROJECT}.email_routes:ROUTES",
        }

        def run(*args: str, cwd: Path = project) -> str:
            done = subprocess.run(
                args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
            )
            assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
            return done.stdout

        run(str(BIN / "create-dagster"), "project", PROJECT, "--no-uv-sync", cwd=tmp_path)
        package = project / "src" / PROJECT
        (package / "email_routes.py").write_text(ROUTES_MODULE)
        (package / "definitions.py").write_text(TOP_LEVEL)
        (package / "defs" / "shop_assets.py").write_text(OWN_DEFS)

        listed = json.loads(run(str(BIN / "dg"), "list", "components", "--json"))
        assert "email_platform.EmailPlatformComponent" in {c["key"] for c in listed["items"]}

        run(
            str(BIN / "dg"),
            "scaffold",
            "defs",
            "email_platform.EmailPlatformComponent",
            "email",
        )
        defs_yaml = package / "defs" / "email" / "defs.yaml"
        text = defs_yaml.read_text()
        assert 'database_url: "{{ env.DATABASE_URL }}"' in text
        assert '# routes: "package.module:ROUTES"' in text
        # The user's own settings: the provider's address from the environment, their templates.
        defs_yaml.write_text(
            text.replace(
                "    name: sandbox\n",
                '    name: sandbox\n    base_url: "{{ env.SANDBOX_URL }}"\n'
                "    sender: shop@example.com\n",
            ).replace("  # templates_dir: templates\n", "  templates_dir: templates\n")
        )
        template = defs_yaml.parent / "templates" / "order_shipped" / "v1"
        template.mkdir(parents=True)
        (template / "subject.txt").write_text("Order {{ order_id }} is on its way\n")
        (template / "text.txt").write_text("Your order {{ order_id }} has shipped.\n")

        assert "All definitions loaded successfully" in run(str(BIN / "dg"), "check", "defs")

        engine = make_engine(database_url)
        upgrade(engine)
        from email_platform import publish

        monkeypatch.setenv("EMAIL_PLATFORM_ROUTES", env["EMAIL_PLATFORM_ROUTES"])
        monkeypatch.syspath_prepend(str(project / "src"))
        with engine.begin() as connection:
            event_id = publish(
                connection,
                event_type="order.shipped",
                aggregate_id="order-1",
                payload={"email": "jane@example.com", "order_id": "order-1"},
            )
        loaded = json.loads(run(sys.executable, "-c", SEND, event_id).strip().splitlines()[-1])

        assert loaded["success"]
        sent = httpx.get(f"{sandbox_url}/_sandbox/messages").json()["messages"]
        assert len(sent) == 1
        assert "Order order-1 is on its way" in json.dumps(sent[0])
    with engine.connect() as connection:
        assert connection.execute(select(email_outbox.c.status)).scalar_one() == "done"
    engine.dispose()

    # Both sets of definitions, side by side: the user's keys and ours, one group of ours, and
    # each job's executor where it chose one, the project's where it did not.
    assert {"warehouse", "database", "email_database", "email_warehouse"} <= set(
        loaded["resources"]
    )
    ours = [key for key in loaded["assets"] if key != "orders"]
    assert ours and all(key.startswith("email_platform/") for key in ours)
    assert loaded["groups"] == ["default", "email_platform"]
    assert loaded["send_executor"] == "in_process"
    assert loaded["asset_job_executor"] == "multiprocess"


def _checkout_metadata(tmp_path: Path) -> Path:
    """This checkout's ``.dist-info`` (entry points included), as installing it would write it.

    The build backend's metadata hook reads ``pyproject.toml`` only; it runs on a copy so no
    build files land in the checkout. First on ``PYTHONPATH``, it stands for the installed
    package's metadata.
    """
    source = tmp_path / "checkout"
    (source / "email_platform").mkdir(parents=True)
    (source / "email_platform" / "__init__.py").touch()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path / "metadata"
    target.mkdir()
    hook = "from setuptools import build_meta as b; print(b.prepare_metadata_for_build_wheel(%r))"
    done = subprocess.run(
        [sys.executable, "-c", hook % str(target)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    dist_info = target / done.stdout.strip().splitlines()[-1]
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "[dagster_dg_cli.registry_modules]" in entry_points
    for extra in target.glob("*.egg-info"):
        shutil.rmtree(extra)
    return target
