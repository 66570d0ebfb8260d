"""`clawbridge preferences`: what you have asked for, in which state, and confirming or forgetting one.

The list reads the data directory's store: every user's preferences, or one user's (`--user`);
`confirm N` and `forget N` ask the running server (`POST /v1/admin/preferences/N/confirm|forget`),
which serves the change to the preference's user from their next request on. A preference's number
names one user's preference (`--user` checks it is that user's).
"""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.table import Table

preferences_app = typer.Typer(
    help="What you have asked for: each preference's state (heard, applied, learned, superseded, dropped), "
         "and confirming or forgetting one (docs/methods.md#preferences-heard-applied-learned).",
    invoke_without_command=True, no_args_is_help=False)
_URL = typer.Option("http://127.0.0.1:30000", "--url", help="The running clawbridge server.")
_KEY = typer.Option(None, "--api-key", envvar="CLAWBRIDGE_API_KEY", help="The server's bearer key.")
_USER = typer.Option(None, "--user", help="One user's preferences (default: every user's).")


@preferences_app.callback()
def listing(
    ctx: typer.Context,
    data_dir: str | None = typer.Option(None, "--data-dir"),
    db: str | None = typer.Option(None),
    user: str | None = _USER,
) -> None:
    """The preferences heard in your corrections: the applied ones are served as an instruction
    now (each user their own), the applied and learned ones are what the gate's twin is asked
    with, and their price."""
    ctx.obj = user
    if ctx.invoked_subcommand is None:
        print_preferences(data_dir, db, user)


def print_preferences(data_dir: str | None, db: str | None, user: str | None = None) -> None:
    from clawbridge.cli.status import _store, newest_priced, price_label
    from clawbridge.learning import preferences, standing

    with _store(data_dir, db) as store:
        history = store.history()
    known = [p for p in history.preferences if user is None or p.user == user]
    if not known:
        Console().print("no preferences yet: none of the judged corrections carried a hint"
                        + (f" in {user}'s turns" if user else ""))
        return
    t = Table("#", "user", "state", "since", "preference", "kind", "heard", "first heard under", "why",
              title=f"what {user} has asked for" if user else "what you have asked for")
    for p in known:
        since = p.state_at.strftime("%Y-%m-%d %H:%M") if p.state_at else "-"
        t.add_row(str(p.id), p.user, p.state, since, p.text, p.kind or "-", str(p.count), f"v{p.first_version}",
                  standing.note(p))
    Console().print(t)
    served = preferences.served_by_user(known)
    one = len({p.user for p in known}) == 1  # one user's: said as before users had their own
    for who, text in served.items():
        Console().print(f"served{'' if one else f' to {who}'} as an instruction now: " + " / ".join(text.splitlines()))
    if not served:
        Console().print("served as an instruction now: nothing")
    if priced := price_label(newest_priced(history.decisions)):
        Console().print(f"price: {priced}")


@preferences_app.command("confirm")
def confirm_cmd(ctx: typer.Context, pref: int = typer.Argument(..., help="The preference's number (#)."),
                url: str = _URL, api_key: str | None = _KEY) -> None:
    """Apply preference N at once, for its user (a hostile or over-long one never applies)."""
    out = _ask(url, api_key, pref, "confirm", ctx.obj)
    typer.echo(f"#{out['id']} is {out['state']}: {out['note']}")


@preferences_app.command("forget")
def forget_cmd(ctx: typer.Context, pref: int = typer.Argument(..., help="The preference's number (#)."),
               url: str = _URL, api_key: str | None = _KEY) -> None:
    """Drop preference N: its instruction stops at once (for its user; nobody else's changes), its
    samples not trained yet are dropped, and the rollback to the version before it is offered."""
    out = _ask(url, api_key, pref, "forget", ctx.obj)
    typer.echo(f"#{out['id']} is dropped: its instruction is no longer served; {out['samples_dropped']} of its "
               "samples not trained yet were dropped")
    if out.get("rollback_command"):
        typer.echo(f"the weights may have learned it since v{out['rollback_to']}; to serve those again: "
                   f"{out['rollback_command']}")


def _ask(url: str, api_key: str | None, pref: int, action: str, user: str | None = None) -> dict[str, Any]:
    from clawbridge.cli.remote import Refused, admin_call

    try:
        return admin_call("POST", url, f"/v1/admin/preferences/{pref}/{action}", api_key, timeout=60,
                          params={"user": user} if user else None,
                          unreachable="start it with `clawbridge up`, or pass --url")
    except Refused as e:
        _fail(action, e.message)
        raise AssertionError from e  # unreachable: _fail exits


def _fail(action: str, message: str) -> None:
    typer.echo(f"clawbridge preferences {action}: {message}", err=True)
    raise typer.Exit(1)
