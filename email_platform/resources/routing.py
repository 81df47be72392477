import importlib

from dagster import ConfigurableResource
from sqlalchemy import Engine

from email_platform.errors import ConfigurationError
from email_platform.recipients import RecipientResolver, SqlDirectoryResolver
from email_platform.rendering import PACKAGE_TEMPLATES, TemplateRenderer
from email_platform.routes import RouteTable, default_routes


class RoutingResource(ConfigurableResource):
    """Routes, templates and the recipient directory.

    ``routes_factory`` is ``"package.module:ROUTES"`` naming a ``RouteTable``, or
    ``"package.module:function"`` returning one (default: the shipped routes); ``templates_dir``
    a directory of ``<name>/v<n>/`` templates; the directory settings say where routes that look
    the recipient up at send time find the address.
    """

    routes_factory: str | None = None
    templates_dir: str | None = None
    directory_table: str = "users"
    directory_key_column: str = "id"
    directory_email_column: str = "email"

    def route_table(self) -> RouteTable:
        if not self.routes_factory:
            return default_routes()
        module_name, _, attribute = self.routes_factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(f"routes_factory {self.routes_factory!r}: {exc}") from None
        # "pkg.module:ROUTES" names a table; "pkg.module:function" one that returns it.
        table = factory if isinstance(factory, RouteTable) else factory()
        if not isinstance(table, RouteTable):
            raise ConfigurationError(f"{self.routes_factory} did not return a RouteTable")
        return table

    def renderer(self) -> TemplateRenderer:
        return TemplateRenderer(self.templates_dir or PACKAGE_TEMPLATES)

    def resolver(self, engine: Engine) -> RecipientResolver:
        return SqlDirectoryResolver(
            engine,
            table_name=self.directory_table,
            key_column=self.directory_key_column,
            email_column=self.directory_email_column,
        )
