from dagster import ConfigurableResource

from email_platform import config
from email_platform.errors import ConfigurationError
from email_platform.providers.base import EmailProvider
from email_platform.providers.sandbox import SandboxProvider


class EmailProviderResource(ConfigurableResource):
    """The email provider the send op hands messages to.

    Empty fields fall back to ``EMAIL_PLATFORM_PROVIDER``, ``EMAIL_PLATFORM_<PROVIDER>_BASE_URL``
    and ``EMAIL_PLATFORM_<PROVIDER>_API_KEY``. One keep-alive client serves a whole run.
    """

    provider: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    sender: str | None = None
    timeout_s: float | None = None
    rate_limit_per_s: float | None = None

    def settings(self) -> config.ProviderSettings:
        env = config.ProviderSettings.from_env()
        name = (self.provider or env.name).lower()
        if self.provider and self.provider.lower() != env.name:
            # The env's base URL belongs to another provider; do not borrow it.
            env = config.ProviderSettings.from_env({config.PREFIX + "PROVIDER": name})
        return config.ProviderSettings(
            name=name,
            base_url=self.base_url or env.base_url,
            api_key=self.api_key or env.api_key,
            sender=self.sender or env.sender,
            timeout_s=self.timeout_s or env.timeout_s,
            rate_limit_per_s=(
                self.rate_limit_per_s if self.rate_limit_per_s is not None else env.rate_limit_per_s
            ),
        )

    def open(self, concurrency: int) -> EmailProvider:
        settings = self.settings()
        if settings.name == "sandbox":
            return SandboxProvider(
                settings.base_url,
                api_key=settings.api_key,
                timeout_s=settings.timeout_s,
                rate_limit_per_s=settings.rate_limit_per_s,
                max_connections=max(1, concurrency),
            )
        raise ConfigurationError(
            f"provider {settings.name!r} has no adapter in this release; use 'sandbox'"
        )
