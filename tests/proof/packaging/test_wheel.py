"""The built wheel alone can build the warehouse: its SQL models and questions ship inside it.

The models are ``analytics/*.sql`` in the checkout, where analysts read them. The package reads
them through ``email_platform/warehouse/sql`` (a symlink to ``analytics/``) with
``importlib.resources``, so a wheel must carry copies of them: a package that found them next to
the checkout worked in development and could not build anything once installed.

This builds the wheel from the checkout's files (offline, with the dev venv's setuptools),
checks that it holds every model and question file, and installs only that wheel into a fresh
venv outside the checkout; the third-party packages come from this interpreter's site-packages
through a ``.pth`` file (whose own ``.pth`` files, among them the editable install's finder,
are not processed, so ``email_platform`` can only come from the wheel). From a directory outside
the checkout, that venv migrates a SQLite database with ``email-platform db upgrade``,
publishes and sends two events and builds the warehouse from scratch.
"""

import json
import os
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

from email_platform import warehouse
from tests.paths import ROOT
from tests.proof.packaging.conftest import run as _run

ANALYTICS = ROOT / "analytics"

CHILD = textwrap.dedent(
    """
    import json, sys
    from importlib.resources import files

    import email_platform
    from email_platform import publish, warehouse
    from email_platform.db.engine import make_engine
    from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane
    from email_platform.providers.base import Accepted
    from email_platform.mail.recipients import NoResolver
    from email_platform.mail.rendering import TemplateRenderer
    from email_platform.mail.routes import demo_routes
    from email_platform.sending.batch import BatchSender

    url, warehouse_path = sys.argv[1:]


    class Accepting:
        name = "sandbox"

        def send(self, email):
            return Accepted(provider_message_id=f"pm-{email.message_id}", status_code=202)

        def close(self):
            pass


    engine = make_engine(url)
    with engine.begin() as connection:
        event_ids = [
            publish(
                connection,
                event_type="user.signed_up",
                aggregate_id=user,
                payload={"user_id": user, "email": f"{user}@example.com", "first_name": "Jo"},
                routes=demo_routes(),
            )
            for user in ("u1", "u2")
        ]
    sender = BatchSender(
        engine=engine,
        provider=Accepting(),
        renderer=TemplateRenderer(),
        routes=demo_routes(),
        resolver=NoResolver(),
        lane=DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL],
        sender_address="Example <no-reply@example.com>",
    )
    sent = sender.run(event_ids, run_id="wheel-test").sent
    summary = warehouse.refresh(url, warehouse_path, full=True)
    reader = warehouse.connect_read_only(warehouse_path)
    try:
        funnel = reader.execute(
            "SELECT event_id, template, final_status FROM email_funnel ORDER BY event_id"
        ).fetchall()
    finally:
        reader.close()
    from email_platform.local.demo import _query_hints

    print(json.dumps({
        "email_platform": email_platform.__file__,
        "sql": str(files("email_platform.warehouse") / "sql"),
        "hints": _query_hints(warehouse_path),
        "event_ids": sorted(event_ids),
        "sent": sent,
        "full_build": summary.full_build,
        "funnel": funnel,
    }))
    """
)


def test_the_wheel_alone_builds_the_warehouse(tmp_path: Path, wheel: Path) -> None:
    models = sorted(path.name for path in ANALYTICS.glob("*.sql"))
    questions = sorted(path.name for path in (ANALYTICS / "questions").glob("*.sql"))
    # File name = table name = asset name: the one list of models is what analytics/ holds.
    assert sorted(name.removesuffix(".sql") for name in models) == sorted(warehouse.MODEL_NAMES)
    assert questions == sorted(f"{name}.sql" for name in warehouse.question_names())

    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"email_platform/warehouse/sql/{name}" for name in models} | {
        f"email_platform/warehouse/sql/questions/{name}" for name in questions
    }
    expected.add("email_platform/warehouse/sql/README.md")  # the demo points analysts at it
    assert expected - shipped == set(), "model or question files missing from the wheel"

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # Installed before the .pth exists, so pip sees an empty environment and touches no other.
    _run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "--disable-pip-version-check", "--quiet", wheel,
    )  # fmt: skip
    site_packages = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        ).stdout.strip()
    )
    ours = dict.fromkeys(sysconfig.get_paths()[kind] for kind in ("purelib", "platlib"))
    (site_packages / "dev_dependencies.pth").write_text("".join(f"{path}\n" for path in ours))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "EMAIL_PLATFORM_"))}
    env["PYTHONNOUSERSITE"] = "1"
    url = f"sqlite:///{elsewhere / 'app.sqlite3'}"
    upgraded = _run(
        venv / "bin" / "email-platform", "db", "upgrade", "--url", url, cwd=elsewhere, env=env
    )
    assert "database at revision" in upgraded.stdout

    child = _run(python, "-c", CHILD, url, elsewhere / "warehouse.duckdb", cwd=elsewhere, env=env)
    found = json.loads(child.stdout.strip().splitlines()[-1])
    # The package, and the SQL it read, came from the wheel's install, not from the checkout.
    assert Path(found["email_platform"]).resolve().is_relative_to(site_packages.resolve())
    assert Path(found["sql"]).resolve().is_relative_to(site_packages.resolve())
    # Every path the demo tells an analyst to open exists in the installed layout (there is no
    # analytics/ folder there), and the command it prints answers the question.
    paths = [Path(word) for line in found["hints"] for word in line.split() if word.startswith("/")]
    assert {path.name for path in paths} >= {
        "welcome_open_rate_last_7_days.sql",
        "questions",
        "README.md",
    }
    for path in paths:
        if path.parent == venv / "bin":  # a command the install put beside its python
            assert path.name in {"duckdb", "email-platform"} and path.exists(), path
        elif path != elsewhere / "warehouse.duckdb":
            assert path.exists() and path.resolve().is_relative_to(site_packages.resolve()), path
    assert all("analytics/" not in line for line in found["hints"])
    assert found["sent"] == 2 and found["full_build"] is True
    assert found["funnel"] == [[event_id, "welcome", "sent"] for event_id in found["event_ids"]]
