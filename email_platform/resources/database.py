from dagster import ConfigurableResource, InitResourceContext
from pydantic import PrivateAttr
from sqlalchemy import Engine

from email_platform.common import config
from email_platform.db.engine import make_engine


class AppDatabase(ConfigurableResource):
    """The application database (outbox, messages, attempts, dead letters, suppressions).

    SQLAlchemy URL; empty means ``EMAIL_PLATFORM_DATABASE_URL`` or the embedded SQLite file
    under ``./.email_platform``.
    """

    url: str | None = None

    _engine: Engine | None = PrivateAttr(default=None)

    def resolved_url(self) -> str:
        return self.url or config.database_url()

    def get_engine(self) -> Engine:
        if self._engine is None:
            self._engine = make_engine(self.resolved_url())
        return self._engine

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
