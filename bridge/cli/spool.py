"""`clawbridge spool status|drain|discard`: the writes a proxy spooled while its store was down
(docs/operating.md#when-the-store-is-down). A running proxy replays its spool by itself; these
are for a spool left behind (the proxy stopped before the store came back)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from clawbridge.config import Settings
    from clawbridge.serving.durable import SpoolConfig

spool_app = typer.Typer(help="The writes spooled while the store was down (docs/operating.md).")


def _settings(data_dir: str | None, db: str | None, spool_dir: str | None) -> tuple[Settings, SpoolConfig]:
    from clawbridge.config import Settings
    from clawbridge.serving.durable import SpoolConfig

    settings = Settings.load(data_dir=data_dir, db=db, spool_dir=spool_dir)
    return settings, SpoolConfig.of(settings)


@spool_app.command("status")
def status_cmd(
    data_dir: str | None = typer.Option(None, "--data-dir"),
    spool_dir: str | None = typer.Option(None, "--spool-dir", help="Default: spool/ in the data directory."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Writes waiting in the spool, their bytes and the oldest one's age (read beside a running proxy)."""
    from clawbridge.store.spool import describe

    _, cfg = _settings(data_dir, None, spool_dir)
    st = describe(cfg.dir)
    if as_json:
        typer.echo(json.dumps(st))
        return
    age = "" if st["oldest_age_s"] is None else f", the oldest {st['oldest_age_s']} s old"
    typer.echo(f"spool {st['dir']}: {st['records']} writes waiting ({st['bytes']} bytes){age}")


@spool_app.command("drain")
def drain_cmd(
    data_dir: str | None = typer.Option(None, "--data-dir"),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default SQLite in the data directory)."),
    spool_dir: str | None = typer.Option(None, "--spool-dir"),
    timeout_s: float = typer.Option(60.0, "--timeout", help="Give up when the store stays down this long."),
) -> None:
    """Replay the spool into the store (with the proxy stopped) and exit when it is empty."""
    from clawbridge.routes import SPOOL_HANDLERS
    from clawbridge.serving.durable import Durable
    from clawbridge.store import Store
    from clawbridge.store.spool import SpoolBusy

    settings, cfg = _settings(data_dir, db, spool_dir)

    async def drain(store: Store) -> tuple[bool, Durable]:
        durable = Durable(store, cfg)
        durable.handlers.update(SPOOL_HANDLERS)
        try:
            durable.open()
            return await durable.drain(timeout_s), durable
        finally:
            await durable.close()

    with Store.open(settings.db_url) as store:
        try:
            done, durable = asyncio.run(drain(store))
        except SpoolBusy as e:
            typer.echo(f"clawbridge spool drain: {e} (a running proxy replays its spool itself)", err=True)
            raise typer.Exit(1) from None
    st = durable.status()
    typer.echo(f"{st['replayed']} writes replayed, {st['writes_lost']} could never be stored")
    if not done:
        typer.echo(f"clawbridge spool drain: the store stayed unavailable; {st['depth']} writes still spooled", err=True)
        raise typer.Exit(1)


@spool_app.command("discard")
def discard_cmd(
    data_dir: str | None = typer.Option(None, "--data-dir"),
    spool_dir: str | None = typer.Option(None, "--spool-dir"),
    yes: bool = typer.Option(False, "--yes", help="Do it: the spooled turns are lost for good."),
) -> None:
    """Throw the spooled writes away (they are never stored)."""
    from clawbridge.store.spool import Spool, SpoolBusy

    _, cfg = _settings(data_dir, None, spool_dir)
    if not yes:
        typer.echo("clawbridge spool discard: the spooled writes would be lost for good; add --yes", err=True)
        raise typer.Exit(2)
    try:
        spool = Spool.open(cfg.dir, cfg.max_bytes)
    except SpoolBusy as e:
        typer.echo(f"clawbridge spool discard: {e}", err=True)
        raise typer.Exit(1) from None
    try:
        n = spool.discard()
    finally:
        spool.close()
    typer.echo(f"{n} spooled writes discarded")
