"""``email-platform``: the operator's command line, one module per command group.

This module imports nothing outside the standard library: the console script enters through
``run()``, which names the extra to install when the command line's dependencies are missing
(the producer's install, ``pip install email-platform``, has none of them). ``main``, the click
group, is loaded on first use.
"""

import sys
from typing import Any

#: The extra that brings each third-party module a command needs.
EXTRA_OF_MODULE = {
    "click": "dagster",
    "dagster": "dagster",
    "dagster_postgres": "dagster",
    "dagster_webserver": "dagster",
    "alembic": "dagster",
    "jinja2": "dagster",
    "httpx": "dagster",
    "httptools": "dagster",
    "psycopg": "dagster",
    "duckdb": "dagster",
    "starlette": "webhooks",
    "uvicorn": "webhooks",
    "cryptography": "webhooks",
    "prometheus_client": "metrics",
    "pandas": "warehouse",
    "botocore": "ses",
    "celery": "celery",
    "dagster_celery": "celery",
}


def missing_extra_message(module: str) -> str | None:
    """What to tell a user whose install lacks ``module``; None for a module no extra brings."""
    extra = EXTRA_OF_MODULE.get(module.partition(".")[0])
    if extra is None:
        return None
    return (
        f"email-platform: this command needs the [{extra}] extra (module {module!r} is not "
        f"installed): pip install 'email-platform[{extra}]'"
    )


def run(argv: list[str] | None = None) -> None:
    """The ``email-platform`` console script."""
    from email_platform.common.errors import ConfigurationError

    try:
        from email_platform.cli.app import main

        main(args=argv)
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc.name or "")
        if message is None:
            raise
        print(message, file=sys.stderr)
        sys.exit(3)
    except ConfigurationError as exc:  # a setting to fix (it names it), not a bug to trace
        print(f"email-platform: {exc}", file=sys.stderr)
        sys.exit(2)


def __getattr__(name: str) -> Any:
    if name == "main":
        from email_platform.cli.app import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
