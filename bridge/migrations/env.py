"""Alembic environment. The store passes an open connection (inside its own transaction, so a
migration is all-or-nothing and concurrent openers serialise); the alembic CLI passes a URL
with `-x url=...` or `sqlalchemy.url`."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from clawbridge.store.schema import metadata

config = context.config


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("give the database: alembic -x url=sqlite:////path/clawbridge.db ...")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        _run(conn)
