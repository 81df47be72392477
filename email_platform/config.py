"""Configuration: every ``EMAIL_PLATFORM_*`` environment variable is read here and only here.

Values are read when asked for, never at import, so tests and the CLI can point one process at
another database or provider by setting the environment before calling in.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX = "EMAIL_PLATFORM_"
DEFAULT_HOME = ".email_platform"
PROVIDERS = ("sandbox", "postmark", "sendgrid", "mailgun", "ses", "resend", "smtp")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def home_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the embedded defaults live (SQLite file, Dagster storage, DuckDB file)."""
    return Path(_env(env).get(PREFIX + "HOME", DEFAULT_HOME)).resolve()


def database_url(env: Mapping[str, str] | None = None) -> str:
    value = _env(env).get(PREFIX + "DATABASE_URL")
    if value:
        return value
    return f"sqlite:///{home_dir(env) / 'email_platform.sqlite3'}"


def warehouse_path(env: Mapping[str, str] | None = None) -> str:
    return _env(env).get(PREFIX + "WAREHOUSE") or str(home_dir(env) / "warehouse.duckdb")


def dagster_home_is_set(env: Mapping[str, str] | None = None) -> bool:
    return bool(_env(env).get("DAGSTER_HOME"))


def dagster_home(env: Mapping[str, str] | None = None) -> Path:
    value = _env(env).get("DAGSTER_HOME")
    return Path(value) if value else home_dir(env) / "dagster"


def lane_overrides_json(env: Mapping[str, str] | None = None) -> str | None:
    """JSON laid over the shipped lane settings, e.g. ``{"bulk": {"batch_size": 1000}}``."""
    return _env(env).get(PREFIX + "LANES") or None


@dataclass(frozen=True)
class ProviderSettings:
    """The provider to send through, with its base URL and credentials."""

    name: str
    base_url: str
    api_key: str | None
    sender: str
    timeout_s: float
    rate_limit_per_s: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ProviderSettings":
        values = _env(env)
        name = values.get(PREFIX + "PROVIDER", "sandbox").strip().lower()
        if name not in PROVIDERS:
            from email_platform.errors import ConfigurationError

            raise ConfigurationError(
                f"{PREFIX}PROVIDER={name!r} is not one of {', '.join(PROVIDERS)}"
            )
        upper = name.upper()
        return cls(
            name=name,
            base_url=values.get(f"{PREFIX}{upper}_BASE_URL", "http://127.0.0.1:8025"),
            api_key=values.get(f"{PREFIX}{upper}_API_KEY"),
            sender=values.get(PREFIX + "SENDER", "Example <no-reply@example.com>"),
            timeout_s=float(values.get(PREFIX + "PROVIDER_TIMEOUT_S", "10")),
            rate_limit_per_s=float(values.get(PREFIX + "PROVIDER_RATE_LIMIT_PER_S", "0")),
        )
