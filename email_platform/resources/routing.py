from dagster import ConfigurableResource
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError
from email_platform.mail.recipients import RecipientResolver, SqlDirectoryResolver
from email_platform.mail.rendering import TemplateRenderer
from email_platform.mail.routes import RouteTable, configured_routes, load_routes


class RoutingResource(ConfigurableResource):
    """Routes, templates and the recipient directory.

    The route table is the one ``EMAIL_PLATFORM_ROUTES`` names (``"package.module:NAME"``, a
    ``RouteTable`` or a function returning one), the setting ``publish()`` reads too;
    ``routes_factory`` names another for this code location only. Unset both, and a run fails
    with a configuration error naming the setting: nothing falls back to the demo's routes.
    ``templates_dir``, a directory of ``<name>/v<n>/`` templates, overrides the table's own
    ``templates_dir``. The directory settings say where routes that look the recipient up at send
    time find the address.
    """

    routes_factory: str | None = None
    templates_dir: str | None = None
    directory_table: str = "users"
    directory_key_column: str = "id"
    directory_email_column: str = "email"

    def route_table(self) -> RouteTable:
        if self.routes_factory:
            return load_routes(self.routes_factory)
        return configured_routes()

    def renderer(self) -> TemplateRenderer:
        directory = self.templates_dir or self.route_table().templates_dir
        if directory is None:
            raise ConfigurationError(
                "no templates: the route table names no templates_dir; set "
                "RouteTable(templates_dir=...) or RoutingResource(templates_dir=...)"
            )
        return TemplateRenderer(directory)

    def resolver(self, engine: Engine) -> RecipientResolver:
        return SqlDirectoryResolver(
            engine,
            table_name=self.directory_table,
            key_column=self.directory_key_column,
            email_column=self.directory_email_column,
        )
