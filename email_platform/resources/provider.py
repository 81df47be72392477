import json

from dagster import ConfigurableResource

from email_platform import config
from email_platform.errors import ConfigurationError
from email_platform.providers.base import EmailProvider
from email_platform.providers.registry import open_provider


class EmailProviderResource(ConfigurableResource):
    """The email provider the send op hands messages to.

    Empty fields fall back to ``EMAIL_PLATFORM_PROVIDER``, ``EMAIL_PLATFORM_<PROVIDER>_BASE_URL``,
    ``EMAIL_PLATFORM_<PROVIDER>_API_KEY`` and the provider's other
    ``EMAIL_PLATFORM_<PROVIDER>_*`` options, read when a run starts (never at import).
    ``options_json`` overrides options, e.g. ``{"domain": "mg.example.com"}`` for Mailgun.
    One keep-alive client serves a whole run.
    """

    provider: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    sender: str | None = None
    timeout_s: float | None = None
    rate_limit_per_s: float | None = None
    options_json: str | None = None

    def settings(self) -> config.ProviderSettings:
        env = config.ProviderSettings.from_env(provider=self.provider)
        options = dict(env.options)
        if self.options_json:
            try:
                extra = json.loads(self.options_json)
            except ValueError as exc:
                raise ConfigurationError(f"provider options are not JSON: {exc}") from None
            options.update({str(k): str(v) for k, v in extra.items()})
        return config.ProviderSettings(
            name=env.name,
            base_url=self.base_url or env.base_url,
            api_key=self.api_key or env.api_key,
            sender=self.sender or env.sender,
            timeout_s=self.timeout_s or env.timeout_s,
            rate_limit_per_s=(
                self.rate_limit_per_s if self.rate_limit_per_s is not None else env.rate_limit_per_s
            ),
            options=options,
        )

    def open(self, concurrency: int) -> EmailProvider:
        return open_provider(self.settings(), max_connections=max(1, concurrency))
