"""The producer's import loads only the core's dependencies, even where every extra is installed.

``pip install email-platform`` brings SQLAlchemy, email-validator, fastjsonschema and orjson
alone (the wheel test in tests/proof/packaging installs it): ``from email_platform import
publish``, a publish, the
testing kit's recording and the route setting must load nothing that an extra brings. Checked in
a child of this (dev) interpreter, where Dagster, Jinja and the rest are importable, so an import
that slipped into the core shows here. OpenTelemetry is the one optional import (``tracing``:
used when installed, skipped when not).
"""

import json
import subprocess
import sys
import textwrap

from tests.paths import ROOT

#: The core's dependencies and theirs; OpenTelemetry is optional ([tracing]).
ALLOWED = {
    "email-platform",
    "sqlalchemy",
    "greenlet",
    "typing-extensions",
    "email-validator",
    "fastjsonschema",
    "orjson",
    "dnspython",
    "idna",
    "importlib-metadata",
    "zipp",
}

CHILD = textwrap.dedent(
    """
    import json, sys
    from importlib.metadata import packages_distributions

    before = set(sys.modules)
    from sqlalchemy import create_engine

    from email_platform import publish, publish_many
    from email_platform.mail.routes import configured_routes
    from email_platform.testing import create_tables, recording_published

    engine = create_engine("sqlite://")
    create_tables(engine)
    with recording_published(engine) as published:
        with engine.begin() as connection:
            publish(
                connection, event_type="user.signed_up", aggregate_id="u1",
                payload={"user_id": "u1", "email": "jo@example.com", "first_name": "Jo"},
            )
            publish_many(connection, [{
                "event_type": "order.paid", "aggregate_id": "o1",
                "payload": {"email": "jo@example.com", "first_name": "Jo", "order_id": 1},
            }])
    assert len(published.events) == 2 and configured_routes().routes
    owners = packages_distributions()
    tops = {name.split(".")[0] for name in set(sys.modules) - before}
    print(json.dumps({
        "loaded": sorted({d.lower().replace("_", "-") for t in tops for d in owners.get(t, [])}),
        "unowned": sorted(t for t in tops if t not in owners and t not in sys.stdlib_module_names
                          and not t.startswith("_")),
    }))
    """
)


def test_publish_loads_only_the_cores_dependencies() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "EMAIL_PLATFORM_ROUTES": "email_platform.mail.routes:demo_routes",
    }
    result = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # ``opentelemetry`` is a namespace package: every opentelemetry-* distribution owns it.
    beyond = {d for d in found["loaded"] if d not in ALLOWED and not d.startswith("opentelemetry-")}
    assert beyond == set(), sorted(beyond)
    # Modules of no installed distribution: this checkout's package, and C helpers.
    assert set(found["unowned"]) <= {"email_platform", "cython_runtime"}, found["unowned"]
