"""The provider's settings from the environment: a bad number is refused naming its variable,
never a bare ValueError or a timeout that fails (or never ends) every call."""

import pytest

from email_platform.common import config
from email_platform.common.errors import ConfigurationError


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan", "inf", "1e308", "3601", "10s"])
def test_a_bad_provider_timeout_is_refused_naming_the_variable(raw):
    env = {"EMAIL_PLATFORM_PROVIDER_TIMEOUT_S": raw}
    with pytest.raises(ConfigurationError, match=f"EMAIL_PLATFORM_PROVIDER_TIMEOUT_S.*{raw!r}"):
        config.ProviderSettings.from_env(env, provider="sandbox")


@pytest.mark.parametrize(("raw", "seconds"), [("", 10.0), ("2.5", 2.5), (" 30 ", 30.0)])
def test_a_provider_timeout_is_read_in_seconds(raw, seconds):
    env = {"EMAIL_PLATFORM_PROVIDER_TIMEOUT_S": raw}
    assert config.ProviderSettings.from_env(env, provider="sandbox").timeout_s == seconds


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "1.5", "1e6", "9999999999"])
def test_a_bad_webhook_body_limit_is_refused_naming_the_variable(raw):
    env = {"EMAIL_PLATFORM_WEBHOOK_MAX_BODY_BYTES": raw}
    with pytest.raises(ConfigurationError, match="EMAIL_PLATFORM_WEBHOOK_MAX_BODY_BYTES"):
        config.webhook_max_body_bytes(env)


def test_the_webhook_body_limit_defaults_to_a_mebibyte():
    assert config.webhook_max_body_bytes({}) == 1024 * 1024
    assert config.webhook_max_body_bytes({"EMAIL_PLATFORM_WEBHOOK_MAX_BODY_BYTES": "4096"}) == 4096


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 7200.0])
def test_a_bad_resource_timeout_is_refused_naming_the_field(value):
    from email_platform.resources import EmailProviderResource

    with pytest.raises(ConfigurationError, match="timeout_s"):
        EmailProviderResource(provider="sandbox", timeout_s=value).settings()
