"""Each side installs only what it needs: the built wheel in fresh venvs, from the package index.

Without extras (``pip install email-platform``, the producer's web service) the venv holds at
most 10 packages and no Dagster; ``publish()`` writes an event into SQLite whose tables
``email_platform.testing.create_tables`` made (the documented way for a product's tests), and
loads nothing but the core's dependencies; the ``email-platform`` command names the extra it
needs instead of a traceback. With ``[dagster]`` the same wheel migrates a database with
``email-platform db upgrade`` and loads the code location's definitions.

Each venv installs from the index through pip's download cache (seconds once cached; about 30 s
for ``[dagster]`` on a cold cache here).
"""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.proof.packaging.conftest import run

#: The distributions the core may load (SQLAlchemy's and email-validator's own included).
CORE_DISTRIBUTIONS = {
    "email-platform",
    "sqlalchemy",
    "greenlet",
    "typing-extensions",
    "email-validator",
    "fastjsonschema",
    "orjson",
    "dnspython",
    "idna",
}

PUBLISH = textwrap.dedent(
    """
    import json, sys
    from importlib.metadata import packages_distributions

    before = set(sys.modules)
    from sqlalchemy import create_engine

    from email_platform import publish
    from email_platform.mail.routes import Route, RouteTable
    from email_platform.common.lanes import Lane
    from email_platform.testing import create_tables, recording_published

    ROUTES = RouteTable(routes=[Route(
        name="shipped", event_type="order.shipped", event_version=1, template="shipped",
        lane=Lane.TRANSACTIONAL,
    )])
    engine = create_engine(f"sqlite:///{sys.argv[1]}")
    create_tables(engine)
    with recording_published(engine) as published:
        with engine.begin() as connection:
            event_id = publish(
                connection, event_type="order.shipped", aggregate_id="o1",
                payload={"email": "jo@example.com", "order_id": 1}, routes=ROUTES,
            )
    tops = {name.split(".")[0] for name in set(sys.modules) - before}
    owners = packages_distributions()
    loaded = sorted(
        {d.lower().replace("_", "-") for top in tops for d in owners.get(top, [])}
    )
    print(json.dumps({
        "event_id": event_id,
        "recorded": [e.event_id for e in published.events],
        "lane": published.events[0].lane,
        "loaded": loaded,
    }))
    """
)


def _venv(tmp_path: Path, wheel: Path, extras: str = "") -> Path:
    """A fresh venv with the wheel (and its dependencies from the index) installed."""
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    run(
        venv / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check",
        "--quiet", f"{wheel}{extras}",
    )  # fmt: skip
    return venv


def _installed(venv: Path) -> dict[str, str]:
    listed = run(venv / "bin" / "python", "-m", "pip", "list", "--format=json").stdout
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listed)}


def _env() -> dict[str, str]:
    """This process's environment without its Python or platform settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "EMAIL_PLATFORM_"))}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_the_producers_install_is_small_and_publishes(tmp_path: Path, wheel: Path) -> None:
    venv = _venv(tmp_path, wheel)
    installed = _installed(venv)
    # pip and setuptools come with every venv (Python 3.11); they count too.
    assert len(installed) <= 10, sorted(installed)
    assert not {name for name in installed if name.startswith("dagster")}, sorted(installed)
    assert {"email-platform", "sqlalchemy", "email-validator"} <= set(installed)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    child = run(
        venv / "bin" / "python", "-c", PUBLISH, elsewhere / "app.sqlite3", cwd=elsewhere, env=_env()
    )
    found = json.loads(child.stdout.strip().splitlines()[-1])
    assert found["recorded"] == [found["event_id"]]
    assert found["lane"] == "transactional"
    assert set(found["loaded"]) <= CORE_DISTRIBUTIONS, found["loaded"]

    # The command line is the [dagster] extra's: it says so, and which command to run.
    script = run(
        sys.executable, "-c", "import subprocess, sys; "
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(r.returncode); print(r.stderr)",
        venv / "bin" / "email-platform", "status", cwd=elsewhere, env=_env(),
    )  # fmt: skip
    code, _, stderr = script.stdout.partition("\n")
    assert code == "3", script.stdout
    assert "pip install 'email-platform[dagster]'" in stderr
    assert "Traceback" not in stderr


@pytest.mark.timeout(600)
def test_the_dagster_extra_migrates_and_loads_the_definitions(tmp_path: Path, wheel: Path) -> None:
    venv = _venv(tmp_path, wheel, "[dagster]")
    installed = _installed(venv)
    assert installed["dagster"] == "1.13.27"
    # The analysts' and Amazon SES's extras stay out (dagster-webserver brings Starlette).
    assert not {"pandas", "botocore", "cryptography", "duckdb-cli"} & set(installed)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    url = f"sqlite:///{elsewhere / 'app.sqlite3'}"
    env = _env()
    upgraded = run(
        venv / "bin" / "email-platform", "db", "upgrade", "--url", url, cwd=elsewhere, env=env
    )
    assert "database at revision" in upgraded.stdout
    loaded = run(
        venv / "bin" / "python", "-c",
        "import dagster as dg\n"
        "from email_platform.definitions import defs\n"
        "dg.Definitions.validate_loadable(defs)\n"
        "repo = defs.get_repository_def()\n"
        "print(len(repo.get_all_jobs()), len(repo.sensor_defs))",
        cwd=elsewhere,
        env={**env, "EMAIL_PLATFORM_ROUTES": "email_platform.mail.routes:demo_routes"},
    )  # fmt: skip
    jobs, sensors = map(int, loaded.stdout.split()[-2:])
    assert jobs >= 4 and sensors >= 3
