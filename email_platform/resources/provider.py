import json
import logging
from collections.abc import Callable

from dagster import ConfigurableResource
from pydantic import PrivateAttr

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.observability import logs
from email_platform.providers.base import EmailProvider
from email_platform.providers.circuit import CLOSED, CircuitBreaker, CircuitSettings
from email_platform.providers.failover import FailoverState
from email_platform.providers.registry import open_failover, open_provider

log = logging.getLogger(__name__)


class EmailProviderResource(ConfigurableResource):
    """The email provider the send op hands messages to.

    Empty fields fall back to ``EMAIL_PLATFORM_PROVIDER``, ``EMAIL_PLATFORM_<PROVIDER>_BASE_URL``,
    ``EMAIL_PLATFORM_<PROVIDER>_API_KEY`` and the provider's other
    ``EMAIL_PLATFORM_<PROVIDER>_*`` options, read when a run starts (never at import).
    ``options_json`` overrides options, e.g. ``{"domain": "mg.example.com"}`` for Mailgun.
    One keep-alive client serves a whole run.

    ``failover_*`` name a secondary provider (else ``EMAIL_PLATFORM_FAILOVER_PROVIDER``) that
    takes over while the primary's circuit breaker is open; ``circuit_*`` set the breaker
    (else ``EMAIL_PLATFORM_CIRCUIT_*``; on by default only with a failover provider). The
    breaker's state lives on this resource instance: one run's every attempt in the process
    shares it (see docs/failover.md).
    """

    provider: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    sender: str | None = None
    timeout_s: float | None = None
    rate_limit_per_s: float | None = None
    options_json: str | None = None
    failover_provider: str | None = None
    failover_base_url: str | None = None
    failover_api_key: str | None = None
    failover_options_json: str | None = None
    circuit_breaker: bool | None = None
    circuit_failures: int | None = None
    circuit_failure_rate: float | None = None
    circuit_min_calls: int | None = None
    circuit_window_s: float | None = None
    circuit_cooldown_s: float | None = None
    circuit_max_cooldown_s: float | None = None

    _failover_state: FailoverState | None = PrivateAttr(default=None)
    _circuit_listener: Callable[[str, Callable[[], str]], object] | None = PrivateAttr(default=None)

    def settings(self) -> config.ProviderSettings:
        env = config.ProviderSettings.from_env(provider=self.provider)
        return config.ProviderSettings(
            name=env.name,
            base_url=self.base_url or env.base_url,
            api_key=self.api_key or env.api_key,
            sender=self.sender or env.sender,
            # None or 0 leaves EMAIL_PLATFORM_PROVIDER_TIMEOUT_S.
            timeout_s=(
                config.checked_timeout(self.timeout_s, "timeout_s")
                if self.timeout_s
                else env.timeout_s
            ),
            rate_limit_per_s=(
                self.rate_limit_per_s if self.rate_limit_per_s is not None else env.rate_limit_per_s
            ),
            options=_with_options(env.options, self.options_json),
        )

    def failover_settings(self) -> config.ProviderSettings | None:
        """The secondary provider, or None: these fields, else ``EMAIL_PLATFORM_FAILOVER_*``."""
        if self.failover_provider:
            env = config.ProviderSettings.from_env(provider=self.failover_provider)
        else:
            env = config.failover_provider_settings()
            if env is None:
                return None
        primary = self.settings()
        return config.ProviderSettings(
            name=env.name,
            base_url=self.failover_base_url or env.base_url,
            api_key=self.failover_api_key or env.api_key,
            sender=primary.sender,
            timeout_s=primary.timeout_s,
            rate_limit_per_s=env.rate_limit_per_s,
            options=_with_options(env.options, self.failover_options_json),
        )

    def circuit_settings(self) -> CircuitSettings | None:
        """The primary's circuit breaker settings, or None when it is off."""
        enabled = self.circuit_breaker
        if enabled is None:
            enabled = config.circuit_breaker_enabled()
        if enabled is None:
            enabled = self.failover_settings() is not None
        if not enabled:
            return None
        values: dict = {"half_open_retry_s": self.settings().timeout_s}
        values.update(config.circuit_overrides())
        for name, _ in config.CIRCUIT_VARIABLES.values():
            field = getattr(self, f"circuit_{name}")
            if field is not None:
                values[name] = field
        try:
            return CircuitSettings(**values)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None

    def open(
        self,
        concurrency: int,
        on_circuit_change: Callable[[str, Callable[[], str]], object] | None = None,
    ) -> EmailProvider:
        """The provider for one attempt. ``on_circuit_change(provider, current_state)`` hears
        each transition of the primary's breaker, and its state at once if it is not closed
        (the send ops mirror it: ``store.circuits.CircuitMirror``); the latest open's listener
        is the one called, as the breaker outlives an attempt."""
        primary = self.settings()
        circuit = self.circuit_settings()
        if circuit is None:
            return open_provider(primary, max_connections=max(1, concurrency))
        self._circuit_listener = on_circuit_change
        if self._failover_state is None:
            name = primary.name

            def changed(old: str, new: str) -> None:
                log.warning(
                    f"circuit breaker of provider {name}: {old} -> {new}",
                    **logs.fields(provider=name, circuit=new),
                )
                listener = self._circuit_listener
                if listener is not None and self._failover_state is not None:
                    listener(name, lambda: self._failover_state.breaker.state)

            self._failover_state = FailoverState(CircuitBreaker(circuit, on_change=changed))
        elif on_circuit_change is not None and self._failover_state.breaker.state != CLOSED:
            state = self._failover_state
            on_circuit_change(primary.name, lambda: state.breaker.state)
        return open_failover(
            primary,
            self.failover_settings(),
            self._failover_state,
            max_connections=max(1, concurrency),
        )


def _with_options(options: dict[str, str], options_json: str | None) -> dict[str, str]:
    merged = dict(options)
    if options_json:
        try:
            extra = json.loads(options_json)
        except ValueError as exc:
            raise ConfigurationError(f"provider options are not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ConfigurationError("provider options must be a JSON object")
        merged.update({str(k): str(v) for k, v in extra.items()})
    return merged
