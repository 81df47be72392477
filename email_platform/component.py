"""``EmailPlatformComponent``: the platform added to a Dagster project with the project's own
tools (``dg scaffold defs email_platform.EmailPlatformComponent email``, ``dg check defs``).

A ``defs.yaml`` names the database, the provider, the route table, the templates folder, the
lanes and the warehouse; ``{{ env.X }}`` reads an environment variable when the definitions
load. ``build_defs`` gives what ``build_definitions()`` gives, with these resources: keys,
executor and loggers chosen so they merge into the project's own without a clash
(docs/dagster-component.md).
"""

import json
import textwrap
from pathlib import Path

import dagster as dg
from pydantic import Field, field_validator

from email_platform.common.config import MAX_TIMEOUT_S, PROVIDERS
from email_platform.common.lanes import LANES
from email_platform.definitions import build_definitions
from email_platform.resources import (
    AppDatabase,
    EmailProviderResource,
    LanePolicy,
    RoutingResource,
    Warehouse,
)

#: The shipped demo's route table, for a project that wants to try the platform before it has
#: routes of its own (named explicitly: nothing falls back to it).
DEMO_ROUTES = "email_platform.mail.routes:demo_routes"


class ProviderSettings(dg.Resolvable, dg.Model):
    """The provider the send jobs hand messages to."""

    name: str = Field(default="sandbox", description=f"One of: {', '.join(PROVIDERS)}.")
    base_url: str | None = Field(default=None, description="The provider's API base URL.")
    api_key_env: str | None = Field(
        default=None,
        description=(
            "Name of the environment variable holding the API key, read when a run starts "
            "(the UI shows the name, never the key). Unset: EMAIL_PLATFORM_<PROVIDER>_API_KEY."
        ),
    )
    sender: str | None = Field(default=None, description="The From address.")
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Timeout of one provider call, in seconds.",
    )
    rate_limit_per_s: float | None = Field(default=None, description="Most calls a second.")
    options: dict[str, str] = Field(
        default_factory=dict,
        description='Provider options, e.g. {"domain": "mg.example.com"} for Mailgun.',
    )

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in PROVIDERS:
            raise ValueError(f"unknown provider {value!r}; expected one of {', '.join(PROVIDERS)}")
        return value


class LaneSettings(dg.Resolvable, dg.Model):
    """Overrides of one lane's shipped settings (``email_platform.common.lanes.LaneConfig``)."""

    batch_size: int | None = None
    concurrency: int | None = None
    interval_s: int | None = None
    max_retries: int | None = None
    retry_delay_s: float | None = None
    max_retry_delay_s: float | None = None
    lease_s: int | None = None
    request_timeout_s: int | None = None
    max_runs_per_tick: int | None = None
    run_priority: int | None = None
    workers: int | None = None
    worker_poll_s: float | None = None
    worker_lifetime_s: int | None = None
    worker_idle_s: int | None = None
    warm_workers: int | None = None
    target_s: float | None = None
    nice: int | None = None
    batches_in_flight: int | None = None
    rate_limit_per_s: float | None = None
    rate_reserved_share: float | None = None


class ScaffoldParams(dg.Model):
    routes: str | None = Field(
        default=None,
        description='The route table, "package.module:ROUTES" (else EMAIL_PLATFORM_ROUTES).',
    )
    provider: str = Field(default="sandbox", description=f"One of: {', '.join(PROVIDERS)}.")


class EmailPlatformScaffolder(dg.Scaffolder[ScaffoldParams]):
    """Writes a ``defs.yaml`` whose every setting is named, commented and read from the
    environment where a deployment differs."""

    @classmethod
    def get_scaffold_params(cls) -> type[ScaffoldParams]:
        return ScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[ScaffoldParams]) -> None:
        params = request.params or ScaffoldParams()
        request.target_path.mkdir(parents=True, exist_ok=True)
        (request.target_path / "defs.yaml").write_text(
            defs_yaml(request.type_name, params.routes, params.provider)
        )


def defs_yaml(type_name: str, routes: str | None, provider: str) -> str:
    """The scaffolded ``defs.yaml``: every setting named, the deployment's from the environment."""
    # Unnamed, the table is EMAIL_PLATFORM_ROUTES, the one setting publish() reads too.
    routes_line = f'routes: "{routes}"' if routes else '# routes: "package.module:ROUTES"'
    return textwrap.dedent(
        f"""\
        type: {type_name}

        attributes:
          # The route table: unset, EMAIL_PLATFORM_ROUTES, the setting publish() reads, so
          # the producer and the workers share one table.
          {routes_line}
          # Your application's database, where publish() writes the outbox (SQLAlchemy URL;
          # `email-platform db upgrade` creates the tables). Unset: EMAIL_PLATFORM_DATABASE_URL.
          database_url: "{{{{ env.DATABASE_URL }}}}"
          provider:
            name: {provider}
            # The variable holding the API key, read when a run starts:
            # api_key_env: {provider.upper()}_API_KEY
          # Your templates (<template>/v<n>/subject.txt, text.txt, html.html), relative to this
          # folder. Unset: the route table's own templates_dir.
          # templates_dir: templates
          # Per-lane overrides of the shipped settings, e.g.:
          # lanes:
          #   bulk: {{batch_size: 500, workers: 2}}
          # The DuckDB file analysts read. Unset: EMAIL_PLATFORM_WAREHOUSE.
          # warehouse_path: "{{{{ env.EMAIL_WAREHOUSE_PATH }}}}"
        """
    )


@dg.scaffold_with(EmailPlatformScaffolder)
class EmailPlatformComponent(dg.Component, dg.Resolvable, dg.Model):
    """Event-driven transactional email: the lane sensors, send and lane-worker jobs, webhook
    ingestion, alerts, retention and the analytics assets, over your database's outbox."""

    routes: str | None = Field(
        default=None,
        description=(
            'The route table: "package.module:ROUTES" (a RouteTable) or a function returning '
            "one. Unset: EMAIL_PLATFORM_ROUTES when a run starts, the setting publish() reads, "
            f'so producer and workers share one table. The demo\'s is "{DEMO_ROUTES}".'
        ),
    )
    database_url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the application database holding the outbox. Unset: "
            "EMAIL_PLATFORM_DATABASE_URL when a run starts, else SQLite under ./.email_platform."
        ),
    )
    provider: ProviderSettings | None = Field(
        default=None,
        description="The email provider. Unset: EMAIL_PLATFORM_PROVIDER and its variables.",
    )
    templates_dir: str | None = Field(
        default=None,
        description=(
            "Folder of <template>/v<n>/ templates; a relative path is read from this "
            "defs.yaml's folder. Unset: the route table's own templates_dir."
        ),
    )
    lanes: dict[str, LaneSettings] = Field(
        default_factory=dict,
        description=(
            f"Per-lane overrides ({', '.join(lane.value for lane in LANES)}), e.g. "
            "{bulk: {batch_size: 500}}; set, they replace EMAIL_PLATFORM_LANES, and unset "
            "fields keep the shipped settings."
        ),
    )
    warehouse_path: str | None = Field(
        default=None,
        description=(
            "DuckDB file analysts read. Unset: EMAIL_PLATFORM_WAREHOUSE, else "
            "./.email_platform/warehouse.duckdb."
        ),
    )
    outcome_handler: str | None = Field(
        default=None,
        description=(
            'The callback handed provider outcomes: "package.module:NAME" (docs/outcomes.md). '
            "Unset: EMAIL_PLATFORM_OUTCOME_HANDLER; neither, and email_outcomes_sensor skips."
        ),
    )

    @field_validator("routes")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        if value is None:
            return value
        module, _, attribute = value.partition(":")
        if not module or not attribute:
            raise ValueError(f'routes must read "package.module:NAME", got {value!r}')
        return value

    @field_validator("lanes")
    @classmethod
    def _known_lanes(cls, value: dict[str, LaneSettings]) -> dict[str, LaneSettings]:
        known = {lane.value for lane in LANES}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown lane(s) {unknown}; expected some of {sorted(known)}")
        return value

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return build_definitions(
            **self.resources(context.path), outcome_handler=self.outcome_handler
        )

    def resources(self, folder: Path) -> dict:
        """The resources by key, relative paths read from ``folder`` (the defs.yaml's)."""
        templates = self.templates_dir
        if templates is not None and not Path(templates).is_absolute():
            templates = str((folder / templates).resolve())
        overrides = {
            lane: settings.model_dump(exclude_none=True) for lane, settings in self.lanes.items()
        }
        return {
            "email_database": AppDatabase(url=self.database_url),
            "email_provider": _provider(self.provider),
            "email_lanes": LanePolicy(overrides_json=json.dumps(overrides) if overrides else None),
            "email_routing": RoutingResource(routes_factory=self.routes, templates_dir=templates),
            "email_warehouse": Warehouse(path=self.warehouse_path),
        }


def _provider(settings: ProviderSettings | None) -> EmailProviderResource:
    if settings is None:
        return EmailProviderResource()
    return EmailProviderResource(
        provider=settings.name,
        base_url=settings.base_url,
        # An EnvVar: read in the run, shown by name; the key never enters the definitions.
        api_key=dg.EnvVar(settings.api_key_env) if settings.api_key_env else None,
        sender=settings.sender,
        timeout_s=settings.timeout_s,
        rate_limit_per_s=settings.rate_limit_per_s,
        options_json=json.dumps(settings.options) if settings.options else None,
    )
