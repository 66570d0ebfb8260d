"""`clawbridge users`: each user's data in the store, counted, and deleting one user's.

The list reads the data directory's store (SQLite in WAL mode or PostgreSQL: it works while a
server runs). `delete NAME` deletes the user's sessions and all that hangs off them, and their
preferences, in one transaction (`store.users`). A server may be training on the store: a step
whose batch lost a sample under it would fail, so the delete goes through the server
(`--url`: `DELETE /v1/admin/users/NAME`, which waits for the step in training) and is refused on
a store a live server holds (SQLite: its serving lock; PostgreSQL: the trainer's lease).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

users_app = typer.Typer(
    help="Each user's data: sessions, turns, preferences and samples by state; deleting one user's "
         "(docs/privacy.md#deleting-data).",
    invoke_without_command=True, no_args_is_help=False)
_DATA_DIR = typer.Option(None, "--data-dir")
_DB = typer.Option(None, help="SQLAlchemy URL (default SQLite in the data directory).")


@users_app.callback()
def listing(ctx: typer.Context, data_dir: str | None = _DATA_DIR, db: str | None = _DB) -> None:
    """Every user with data in the store: sessions, turns, preferences, samples by state."""
    if ctx.invoked_subcommand is not None:
        return
    from clawbridge.cli.status import _store

    with _store(data_dir, db) as store:
        counts = store.user_counts()
    if not counts:
        Console().print("no users yet: nothing captured")
        return
    states = list(counts[0].samples)
    t = Table("user", "sessions", "turns", "preferences", *(f"samples {s}" for s in states), title="users")
    for c in counts:
        t.add_row(c.user, str(c.sessions), str(c.turns), str(c.preferences), *(str(c.samples[s]) for s in states))
    Console().print(t)


@users_app.command("delete")
def delete_cmd(
    name: str = typer.Argument(..., help="The user whose data to delete."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    url: str | None = typer.Option(None, "--url", help="Delete through this running server (needed while one serves from the store)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="CLAWBRIDGE_API_KEY", help="With --url: an admin key."),
    data_dir: str | None = _DATA_DIR,
    db: str | None = _DB,
) -> None:
    """Delete NAME's sessions, turns, next states, judgments, samples (trained ones too), episodes
    and preferences. The shared adapter is not untrained: what its versions learned from them stays
    in their weights (the rollback to the version before is offered)."""
    from clawbridge.serving.users import valid_name

    if not valid_name(name):
        _fail(f"{name!r} is no user's name (1 to 64 letters, digits, '.', '_', '@' or '-')")
    if url is not None:
        if not yes:
            typer.confirm(f"Delete all of {name}'s data through {url}?", abort=True)
        _report(_ask(url, api_key, name))
        return
    from clawbridge.cli.status import _store

    with _store(data_dir, db) as store:
        _refuse_if_served(store, name)
        mine = next((c for c in store.user_counts() if c.user == name), None)
        if mine is None:
            _fail(f"no data of {name!r} in the store (`clawbridge users` lists who has some)")
        assert mine is not None
        if not yes:
            trained = mine.samples.get("trained", 0)
            typer.confirm(f"Delete {name}'s {mine.sessions} sessions, {mine.turns} turns, {mine.preferences} "
                          f"preferences and their samples ({trained} trained)?", abort=True)
        _report(store.delete_user(name).as_json())


def _refuse_if_served(store: Any, name: str) -> None:
    """A live server on this store: the delete must go through it (see the module's doc). The
    SQLite store stays held while the delete runs, so no server starts under it."""
    from clawbridge.store import StoreInUse

    how = f"delete through it: clawbridge users delete {name} --url http://HOST:PORT (with an admin --api-key)"
    if store.dialect == "sqlite":
        try:
            store.claim_serving()
        except StoreInUse as e:
            _fail(f"{e.args[0].split(':')[0]}: {how}")
        return
    lease = store.lease("trainer")
    if lease is not None and lease.expires_at > datetime.now(UTC):
        _fail(f"a server ({lease.holder}) trains on this store: {how}")


def _report(out: dict[str, Any]) -> None:
    rows = out["deleted"]
    typer.echo(f"deleted {out['user']}'s data: " + ", ".join(f"{n} {table}" for table, n in rows.items()))
    if out["trained_samples"]:
        typer.echo(f"{out['trained_samples']} of the samples deleted had been trained (from step "
                   f"{out['first_step']} on): the shared adapter's weights since v{out['rollback_to']} may still "
                   f"carry what they learned; to serve weights that never saw them: {out['rollback_command']}")


def _ask(url: str, api_key: str | None, name: str) -> dict[str, Any]:
    from clawbridge.cli.remote import Refused, admin_call

    try:
        return admin_call("DELETE", url, f"/v1/admin/users/{name}", api_key, timeout=120,
                          unreachable="start it, or delete from the store without --url")
    except Refused as e:
        _fail(e.message)
        raise AssertionError from e  # unreachable: _fail exits


def _fail(message: str) -> None:
    typer.echo(f"clawbridge users delete: {message}", err=True)
    raise typer.Exit(1)
