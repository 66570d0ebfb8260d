"""Read-outs of a data directory and the running server: `status`, `versions`, `rollback`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from clawbridge.store import GateRecord, PolicyVersionRow, Preference


def _store(data_dir: str | None, db: str | None):  # type: ignore[no-untyped-def]
    from clawbridge.config import Settings
    from clawbridge.store import Store

    settings = Settings.load(data_dir=data_dir, db=db)
    return Store.open(settings.db_url)


def checked_user(command: str, user: str | None) -> str | None:
    """The user a `--user` option names (None: none named); exits saying what a name is."""
    from clawbridge.serving.users import valid_name

    if user is not None and not valid_name(user):
        typer.echo(f"clawbridge {command}: {user!r} is no user's name (1 to 64 letters, digits, '.', '_', '@' or '-')",
                   err=True)
        raise typer.Exit(2)
    return user


def print_status(data_dir: str | None, db: str | None, user: str | None = None) -> None:
    """Everyone's status; `user`: that user's counts, preferences and own adapter's steps,
    versions and gate (docs/learning.md#each-user-their-own-adapter; the cost is left out)."""
    from clawbridge.backends.costs import read_spend
    from clawbridge.config import Settings

    with _store(data_dir, db) as store:
        st = store.stats(user)
        steps = store.training_steps(user)
        lease = store.lease("trainer") if store.shared else None  # several proxies: docs/scale-out.md
        history = store.history(user)
        newest = store.latest_version(user)
        known = history.preferences if user is None else store.preferences(user)
    decisions = history.decisions
    t = Table("", "", title="clawbridge status" + ("" if user is None else f" of user {user}"))
    t.add_row("sessions (done)", f"{st.sessions} ({st.sessions_done})")
    t.add_row("turns: main / side / untagged / opted out", f"{st.main_turns} / {st.side_turns} / {st.untagged_turns} / {st.opted_out_turns}")
    t.add_row("awaiting a next state", str(st.awaiting_next_state))
    t.add_row("judged turns", str(st.judged_turns))
    t.add_row("samples", " · ".join(f"{k} {v}" for k, v in st.samples.items()))
    whose = "" if user is None else " of their own adapter"
    t.add_row("training steps" + whose, str(len(steps)))
    t.add_row("policy version" + whose, f"v{newest.version if newest else 0}")
    t.add_row("preferences", preferences_line(known))
    if lease is not None:
        t.add_row("trainer (lease)", f"{lease.holder}, claimed until {lease.expires_at:%Y-%m-%d %H:%M:%S} UTC")
    spend = None if user is not None else read_spend(Settings.load(data_dir=data_dir, db=db).data_dir / "costs.json")
    if spend is not None:
        budget = spend.get("budget_usd")
        t.add_row("spend (estimate)", f"${spend['spent_usd']} on {spend['platform']}"
                  + (f" of ${budget} budget" if budget is not None else "")
                  + ("" if spend.get("training_allowed", True) else " — training stopped"))
    if decisions:
        held = sum(d.decision == "rejected" for d in decisions)
        last = decisions[-1]
        t.add_row("gate", f"{len(decisions) - held} accepted, {held} held back; last: v{last.candidate} "
                  f"{gate_label(last)}")
        if user is None and (priced := price_label(newest_priced(decisions))):
            t.add_row("price of your preferences", priced)
    if steps:
        m = steps[-1].metrics
        t.add_row("last step", f"#{steps[-1].step}: loss {m.get('loss', 0):.4f}, mean reward {m.get('mean_reward', 0):+.2f}")
    Console().print(t)


def preferences_line(known: Sequence[Preference]) -> str:
    """How many preferences are in each state (every user's), and what is served as an instruction
    now: the one user's, or how many users are served one."""
    from clawbridge.learning.preferences import served_by_user

    if not known:
        return "none heard yet"
    counts = {s: sum(p.state == s for p in known) for s in ("applied", "learned", "heard", "superseded", "dropped")}
    served = served_by_user(known)
    if len({p.user for p in known}) > 1:
        now = f"; served now to {len(served)} user{'s' * (len(served) != 1)}"
    else:
        now = "".join(f"; served now: {' / '.join(x.splitlines())}" for x in served.values()) or "; none served now"
    return " · ".join(f"{n} {s}" for s, n in counts.items() if n) + now + " (clawbridge preferences)"


def version_origin(row: PolicyVersionRow) -> str:
    """What made a version: its training step, the rollback it is, or the blend the gate served
    (a held-back candidate's delta scaled toward the base)."""
    if row.step is not None:
        return str(row.step)
    if row.copy_of is not None:
        return f"rollback of v{row.copy_of}"
    if row.blend_of is not None:
        from clawbridge.learning.promotion import blend_name

        return blend_name(row.blend_of, float(row.blend_alpha or 0.0))
    return "-"


def gate_label(record: GateRecord | None) -> str:
    """The gate's decision on a version, with the figure that decided it."""
    if record is None:
        return "-"
    figures = record.figures
    probe = figures.get("probe_candidate")
    shown = f" (probe {probe:.0%})" if isinstance(probe, int | float) else ""
    if isinstance(probe, int | float) and "probe_twin" in figures:
        shown = (f" (probe {probe:.0%}; twin {figures['probe_twin']:.0%}, v0 {figures['probe_v0']:.0%}: "
                 f"price {figures['price_points']:.0f} pts)")
    if record.decision == "rejected":
        return f"rejected by the gate: {record.reason}"
    return f"accepted{shown}"


def newest_priced(decisions: Sequence[GateRecord]) -> GateRecord | None:
    """The newest gate decision that measured the price of the preferences."""
    return next((d for d in reversed(decisions) if "price_points" in d.figures), None)


def price_label(record: GateRecord | None) -> str:
    """What the preferences the twin was asked with cost on the general probe, in words."""
    if record is None or "price_points" not in record.figures:
        return ""
    figures = record.figures
    return (f"{figures['price_points']:.0f} pts of general answers (v0 {figures['probe_v0']:.0%}, asked for "
            f"{_n(record.asked)} {figures['probe_twin']:.0%})")


def _n(asked: str | None) -> str:
    n = len((asked or "").splitlines())
    return "it" if n == 1 else f"these {n}"


def print_versions(data_dir: str | None, db: str | None, user: str | None = None) -> None:
    """Every version (`user`: that user's lineage), with whose it is once several users have one."""
    with _store(data_dir, db) as store:
        rows = [r for r in store.versions(user) if r.version]
        gate = store.history(user).by_version()
    several = user is None and len({r.user for r in rows}) > 1
    t = Table("version", *(["user"] if several else []), "step", "samples", "mean reward", "gate", "when (UTC)",
              "weights", title=None if user is None else f"versions of user {user}")
    t.add_row("v0", *(["everyone"] if several else []), "-", "-", "-", "-", "-", "base model")
    for r in rows:
        reward = "-" if r.mean_reward is None else f"{r.mean_reward:+.2f}"
        t.add_row(f"v{r.version}", *([r.user] if several else []), version_origin(r), str(r.samples), reward,
                  gate_label(gate.get(r.version)), r.created_at.strftime("%Y-%m-%d %H:%M:%S"), r.path or "-")
    Console().print(t)


def request_rollback(url: str, version: str, api_key: str | None, timeout_s: float = 600.0) -> None:
    """`clawbridge rollback`: ask the running server, print what it did or why not."""
    from clawbridge.cli.remote import Refused, admin_call

    text = version.strip().lower().removeprefix("v")
    if not text.isdigit():
        _fail(f"VERSION must be a version number like 3 or v3, not {version!r}")
    try:
        # a rollback waits for a running training step to finish: allow for a long one
        out = admin_call("POST", url, "/v1/admin/rollback", api_key, timeout=timeout_s, json={"version": int(text)},
                         unreachable="start it with `clawbridge up`, or pass --url")
    except Refused as e:
        if e.timed_out:
            _fail(f"{e.message} (a training step may still be running)")
        if e.status == 404 and e.code != "version_not_found":
            _fail(f"{url} has no rollback route: is it a clawbridge server running with training on (not --no-train)?")
        _fail(e.message)
        return
    typer.echo(f"policy@v{out['version']} now serves the weights of v{out['restored']} "
               f"(was v{out['previous']}); training continues from them")


def _fail(message: str) -> None:
    typer.echo(f"clawbridge rollback: {message}", err=True)
    raise typer.Exit(1)
