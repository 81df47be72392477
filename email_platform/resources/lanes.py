import dataclasses
import json
import math

from dagster import ConfigurableResource

from email_platform.common import config
from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, LANES, LaneConfig, parse_lane
from email_platform.sending.shared_rate import RatePlan, plan_for


class LanePolicy(ConfigurableResource):
    """Per-lane batch size, concurrency, retries and leases.

    ``overrides_json`` is a JSON object like ``{"bulk": {"batch_size": 1000}}`` laid over the
    shipped defaults; empty means ``EMAIL_PLATFORM_LANES`` from the environment.
    """

    overrides_json: str | None = None

    def config_for(self, lane: str) -> LaneConfig:
        parsed = parse_lane(lane)
        base = DEFAULT_LANE_CONFIGS[parsed]
        overrides = self._overrides().get(parsed.value, {})
        try:
            lane_config = dataclasses.replace(base, **overrides)
        except TypeError as exc:
            raise ConfigurationError(f"lane override for {parsed.value}: {exc}") from None
        if "warm_workers" not in overrides and lane_config.warm_workers > lane_config.workers:
            # The shipped warm worker goes with the shipped workers: `workers: 0` (batch runs)
            # alone is a whole setting, not a contradiction.
            lane_config = dataclasses.replace(lane_config, warm_workers=lane_config.workers)
        if not lane_config.lease_s > 0:
            raise ConfigurationError(
                f"lane override for {parsed.value}: lease_s must be positive, "
                f"got {lane_config.lease_s}"
            )
        if not 0 <= lane_config.nice <= 19:
            raise ConfigurationError(
                f"lane override for {parsed.value}: nice must be 0 to 19, got {lane_config.nice}"
            )
        in_flight = lane_config.batches_in_flight
        if type(in_flight) is not int or in_flight < 1:
            raise ConfigurationError(
                f"lane override for {parsed.value}: batches_in_flight must be a whole number "
                f"from 1, got {in_flight!r}"
            )
        rate, share = lane_config.rate_limit_per_s, lane_config.rate_reserved_share
        if not (isinstance(rate, int | float) and math.isfinite(rate) and rate >= 0):
            raise ConfigurationError(
                f"lane override for {parsed.value}: rate_limit_per_s must be a number >= 0 "
                f"(0: no cap), got {rate!r}"
            )
        if not (isinstance(share, int | float) and 0 <= share < 1):
            raise ConfigurationError(
                f"lane override for {parsed.value}: rate_reserved_share must be a number from 0 "
                f"to below 1, got {share!r}"
            )
        if not 0 <= lane_config.warm_workers <= lane_config.workers:
            raise ConfigurationError(
                f"lane override for {parsed.value}: warm_workers must be 0 to workers "
                f"({lane_config.workers}), got {lane_config.warm_workers}"
            )
        return lane_config

    def rate_plan(self, provider: str, provider_per_s: float, lane: LaneConfig) -> RatePlan | None:
        """The shared-rate buckets ``lane`` draws from (``sending.shared_rate``), knowing every
        lane's reserved share; None when no rate is set."""
        return plan_for(provider, provider_per_s, lane, [self.config_for(name) for name in LANES])

    def _overrides(self) -> dict[str, dict]:
        raw = self.overrides_json or config.lane_overrides_json()
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise ConfigurationError(f"lane overrides are not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigurationError("lane overrides must be a JSON object keyed by lane")
        return value
