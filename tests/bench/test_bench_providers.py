"""``--provider``: every system of ``bench.send`` sends through one adapter, and the
``postmark-stub`` one is the real Postmark adapter against the sandbox's Postmark endpoints."""

import httpx
import pytest

from bench.providers import dagster_env, open_bench_provider
from email_platform.common.config import ProviderSettings
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.registry import open_provider
from email_platform.sandbox.server import SandboxConfig, SandboxServer


def _email(n: int) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=n,
        event_id=f"e{n}",
        idempotency_key=f"k{n}",
        sender="a@example.com",
        to=f"u{n}@example.com",
        subject="s",
        text="t",
        html=None,
        template="w",
        lane="bulk",
    )


@pytest.mark.parametrize("name", ["sandbox", "postmark-stub"])
def test_each_bench_provider_batches_against_the_sandbox(name):
    with SandboxServer(SandboxConfig()) as url:
        provider = open_bench_provider(name, url, batch_max=3, max_connections=2)
        results = provider.send_many([_email(1), _email(2), _email(3)])
        provider.close()
        stats = httpx.get(f"{url}/_sandbox/stats").json()
    assert [type(r).__name__ for r in results] == ["Accepted"] * 3
    assert (stats["batch_requests"], stats["accepted"]) == (1, 3)


def test_the_dagster_system_is_configured_for_the_same_adapter_and_rate():
    env = dagster_env("postmark-stub", "http://127.0.0.1:1", batch_max=100, rate_limit_per_s=50)
    settings = ProviderSettings.from_env(env)
    assert (settings.name, settings.base_url, settings.rate_limit_per_s) == (
        "postmark",
        "http://127.0.0.1:1",
        50.0,
    )
    provider = open_provider(settings, max_connections=1)
    assert provider.batch_max == 100  # type: ignore[attr-defined]
    provider.close()
    assert "EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S" not in dagster_env(
        "sandbox", "http://x", batch_max=1, rate_limit_per_s=0
    )
