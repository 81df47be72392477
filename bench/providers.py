"""The adapter every system of the bench sends through, chosen once (``--provider``): the
sandbox's own API, or the sandbox speaking Postmark's (``postmark-stub``: the real Postmark
adapter against ``/email`` and ``/email/batch``), so Dagster, Celery and the ceiling compare
the same adapter against the same server."""

from typing import Any

PROVIDERS = ("sandbox", "postmark-stub")


def open_bench_provider(
    name: str, url: str, *, batch_max: int, max_connections: int, timeout_s: float = 30.0
) -> Any:
    if name == "sandbox":
        from email_platform.providers.sandbox import SandboxProvider

        return SandboxProvider(
            url, max_connections=max_connections, timeout_s=timeout_s, batch_max=batch_max
        )
    if name == "postmark-stub":
        from email_platform.providers.postmark import PostmarkProvider

        return PostmarkProvider(
            url,
            server_token="bench",
            batch_max=batch_max,
            max_connections=max_connections,
            timeout_s=timeout_s,
        )
    raise ValueError(f"provider {name!r}: say one of {', '.join(PROVIDERS)}")


def dagster_env(name: str, url: str, *, batch_max: int, rate_limit_per_s: float) -> dict[str, str]:
    """The ``EMAIL_PLATFORM_*`` settings that send the Dagster system through ``name``, with
    the shared rate (0: none)."""
    if name == "sandbox":
        env = {
            "EMAIL_PLATFORM_PROVIDER": "sandbox",
            "EMAIL_PLATFORM_SANDBOX_BASE_URL": url,
            "EMAIL_PLATFORM_SANDBOX_BATCH_MAX": str(batch_max),
        }
    elif name == "postmark-stub":
        env = {
            "EMAIL_PLATFORM_PROVIDER": "postmark",
            "EMAIL_PLATFORM_POSTMARK_BASE_URL": url,
            "EMAIL_PLATFORM_POSTMARK_API_KEY": "bench",
            "EMAIL_PLATFORM_POSTMARK_BATCH_MAX": str(batch_max),
        }
    else:
        raise ValueError(f"provider {name!r}: say one of {', '.join(PROVIDERS)}")
    if rate_limit_per_s > 0:
        env["EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S"] = str(rate_limit_per_s)
    return env
