"""``BrakePolicy``: the thresholds at which the bulk lane's brakes pause it."""

from dataclasses import dataclass

from dagster import ConfigurableResource

from email_platform.common import config
from email_platform.common.errors import ConfigurationError


@dataclass(frozen=True)
class BrakeSettings:
    enabled: bool
    #: Fewer accepted messages than this in the window: the rates mean nothing yet.
    min_messages: int
    #: Pause when the share of accepted messages hard-bounced is over this.
    max_hard_bounce_rate: float
    #: Pause when the share of accepted messages complained about is over this.
    max_complaint_rate: float
    #: How far back the rates look (never before the lane's last resume).
    window_s: float


class BrakePolicy(ConfigurableResource):
    """Thresholds of the bulk lane's brakes; each unset field comes from
    ``EMAIL_PLATFORM_BRAKE*`` (``config.brake_settings``) when the brake evaluates."""

    enabled: bool | None = None
    min_messages: int | None = None
    max_hard_bounce_rate: float | None = None
    max_complaint_rate: float | None = None
    window_s: float | None = None

    def settings(self) -> BrakeSettings:
        try:
            env = config.brake_settings()
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        settings = BrakeSettings(
            enabled=bool(env["enabled"]) if self.enabled is None else self.enabled,
            min_messages=int(
                env["min_messages"] if self.min_messages is None else self.min_messages
            ),
            max_hard_bounce_rate=_pick(self.max_hard_bounce_rate, env["hard_bounce_rate"]),
            max_complaint_rate=_pick(self.max_complaint_rate, env["complaint_rate"]),
            window_s=_pick(self.window_s, env["window_s"]),
        )
        if settings.min_messages < 1:
            raise ConfigurationError(f"brake min_messages must be at least 1, got {settings}")
        for name in ("max_hard_bounce_rate", "max_complaint_rate"):
            if not 0.0 <= getattr(settings, name) <= 1.0:
                raise ConfigurationError(f"brake {name} must be in [0, 1], got {settings}")
        if not settings.window_s > 0:
            raise ConfigurationError(f"brake window_s must be positive, got {settings}")
        return settings


def _pick(value: float | None, default: float) -> float:
    return float(default if value is None else value)
