"""`clawbridge demo`: runs a scenario with a progress bar, then prints the held-out table.

On a terminal the progress is a live bar; piped to a file it is one plain line per event (no
redraws, no carriage returns), so a log of the run reads top to bottom.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from clawbridge.demo.rounds import Progress as ProgressFn
    from clawbridge.demo.tools import ToolsScenario


class _Result(Protocol):
    plot: str | None

    @property
    def improved(self) -> bool: ...

    def summary(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=_Result)


def run_demo_command(
    scenario_name: str,
    *,
    model: str | None,
    method: str | None,
    rounds: int | None,
    data_dir: str | None,
    out: str,
    as_json: bool,
    seed: int,
    print_settings: bool = False,
    instant: bool = False,
    control: bool = False,
) -> None:
    from clawbridge.demo import runner as demo
    from clawbridge.demo import scenario, tools
    from clawbridge.demo.rounds import default_data_dir, engine_dtype

    console = Console(stderr=as_json)
    try:
        agentic = tools.load(scenario_name)
    except ValueError as e:
        typer.echo(f"clawbridge demo: {e}", err=True)
        raise typer.Exit(2) from e
    if agentic is not None:
        if instant:
            typer.echo("clawbridge demo: the tools scenario has no simulated user's preference to serve; "
                       "--instant does not apply", err=True)
            raise typer.Exit(2)
        run_tools_command(agentic, console, model=model, method=method, rounds=rounds, data_dir=data_dir,
                          out=out, as_json=as_json, seed=seed, print_settings=print_settings)
        return
    if scenario_name == "two_users":
        if instant or method is not None:
            typer.echo("clawbridge demo: the two_users scenario serves the weights alone with the demo's recipe; "
                       "--instant and --method do not apply", err=True)
            raise typer.Exit(2)
        run_two_users_command(console, model=model, rounds=rounds, data_dir=data_dir, out=out, as_json=as_json,
                              seed=seed, print_settings=print_settings, control=control)
        return
    if control:
        typer.echo("clawbridge demo: --control applies to the two_users scenario", err=True)
        raise typer.Exit(2)
    try:
        sc = scenario.load(scenario_name)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"clawbridge demo: {e}", err=True)
        raise typer.Exit(2) from e
    if rounds is not None:
        sc = sc.model_copy(update={"recipe": sc.recipe.model_copy(update={"rounds": rounds})})
    # printing only: no temporary directory is made
    folder = Path(data_dir) if data_dir else Path("TEMPORARY") if print_settings else default_data_dir()
    # --instant: served as `clawbridge up` serves (the demo's recipe serves the weights alone)
    settings = demo.demo_settings(sc, folder, model=model, seed=seed, method=method,
                                  instant_preferences=True if instant else None)
    if print_settings:
        typer.echo(json.dumps(settings.flat(), indent=2))
        return
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    console.print(
        f"[bold]clawbridge demo[/] · scenario [cyan]{sc.name}[/]: {sc.description}\n"
        f"  model {settings.model} ({engine_dtype(settings)}) · method {settings.training.method} · {sc.recipe.rounds} steps of "
        f"{settings.training.batch_size} conversations · {len(sc.heldout_prompts)} held-out prompts × "
        f"{sc.recipe.eval_samples} · data {folder}",
        soft_wrap=True,  # piped, a path cut at 80 columns cannot be copied
    )
    out_dir = Path(out)

    def note(line: str) -> None:  # teachability and the price, said before the first round
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)

    result = _with_progress(
        console, 2 * sc.recipe.rounds + 1,
        lambda progress: demo.run_demo(sc, settings, progress=progress, plot_path=out_dir / f"{sc.name}.png",
                                       note=note),
    )
    lines = [f"  [dim]{ex['prompt']}[/]\n    before: {ex['before']!r}\n    after:  {ex['after']!r}"
             for ex in result.examples[:2]]
    _report(console, result, sc.name, out_dir, f"held-out prompts the training never saw ({sc.name})",
            demo.result_table(result), lines, as_json=as_json)


def run_two_users_command(
    console: Console, *, model: str | None, rounds: int | None, data_dir: str | None, out: str, as_json: bool,
    seed: int, print_settings: bool, control: bool,
) -> None:
    """Two people, two preferences, one server (`--scenario two_users`): each user's gain and the
    crosstalk between them."""
    from clawbridge.demo import two_users
    from clawbridge.demo.rounds import default_data_dir, engine_dtype

    folder = Path(data_dir) if data_dir else Path("TEMPORARY") if print_settings else default_data_dir()
    settings = two_users.two_users_settings(folder, model=model, seed=seed)
    if print_settings:
        typer.echo(json.dumps(settings.flat(), indent=2))
        return
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    n = rounds or two_users.sides()[0].own.recipe.rounds
    console.print(
        "[bold]clawbridge demo[/] · scenario [cyan]two_users[/]: "
        + ", ".join(f"{user} wants {sc}" for user, sc in two_users.PAIR) + ", on one server\n"
        f"  model {settings.model} ({engine_dtype(settings)}) · {n} steps of {settings.training.batch_size} "
        f"conversations each · data {folder}" + (" · with the control (each user alone)" if control else ""),
        soft_wrap=True,
    )

    def note(line: str) -> None:
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)

    result = _with_progress(console, n + 2, lambda progress: two_users.run_two_users(
        settings, rounds=n, control=control, progress=progress, note=note))
    lines = [f"  [dim]{u.examples[0]['prompt']}[/]\n    {name}: {u.examples[0]['answer']!r}"
             for name, u in result.users.items() if u.examples]
    _report(console, result, two_users.NAME, Path(out), "held-out prompts the training never saw, each user's own",
            two_users.result_table(result), lines, as_json=as_json)


def run_tools_command(
    sc: ToolsScenario,
    console: Console,
    *,
    model: str | None,
    method: str | None,
    rounds: int | None,
    data_dir: str | None,
    out: str,
    as_json: bool,
    seed: int,
    print_settings: bool = False,
) -> None:
    """The agentic scenario (`--scenario tools`): groups of tool-calling episodes through the SDK."""
    from clawbridge.demo import tools
    from clawbridge.demo.rounds import default_data_dir

    if method is not None:
        typer.echo("clawbridge demo: the tools scenario trains from outcomes (GRPO within each group); "
                   "--method does not apply", err=True)
        raise typer.Exit(2)
    if rounds is not None:
        sc = sc.model_copy(update={"recipe": sc.recipe.model_copy(update={"rounds": rounds})})
    r = sc.recipe
    # printing only: no temporary directory is made
    folder = Path(data_dir) if data_dir else Path("TEMPORARY") if print_settings else default_data_dir()
    settings = tools.tools_settings(sc, folder, model=model, seed=seed)
    if print_settings:
        typer.echo(json.dumps(settings.flat(), indent=2))
        return
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    console.print(
        f"[bold]clawbridge demo[/] · scenario [cyan]{sc.name}[/]: {sc.description}\n"
        f"  model {settings.model} · {r.rounds} rounds of {r.groups} groups × {r.n} episodes · "
        f"{len(sc.heldout_tasks)} held-out tasks × {r.eval_samples} · data {folder}",
        soft_wrap=True,  # piped, a path cut at 80 columns cannot be copied
    )
    out_dir = Path(out)
    result = _with_progress(
        console, 2 * r.rounds + 1,
        lambda progress: tools.run_tools_demo(sc, settings, progress=progress, plot_path=out_dir / f"{sc.name}.png"),
    )
    lines = [f"  [dim]{ex['prompt']} (code {ex['code']})[/]\n    before: {ex['before']}\n    after:  {ex['after']}"
             for ex in result.examples[:3]]
    _report(console, result, sc.name, out_dir, f"held-out tasks the training never saw ({sc.name})",
            tools.result_table(result), lines, as_json=as_json)


def _with_progress(console: Console, total: int, run: Callable[[ProgressFn], Coroutine[Any, Any, R]]) -> R:
    """Run a demo under the progress display of `total` phases."""
    from clawbridge.demo.rounds import DemoStopped, NothingToTrain

    try:
        with _progress(console, total) as progress:
            return asyncio.run(run(progress))
    except DemoStopped as e:
        typer.echo(f"clawbridge demo: {e}", err=True)
        raise typer.Exit(130) from None
    except NothingToTrain as e:
        typer.echo(f"clawbridge demo: nothing to train: {e}", err=True)
        raise typer.Exit(1) from None


@contextlib.contextmanager
def _progress(console: Console, total: int) -> Iterator[ProgressFn]:
    """A live bar on a terminal; elsewhere one line per event, with the seconds since the start."""
    if not console.is_terminal:
        t0 = time.monotonic()

        def line(phase: str, done: int, total: int) -> None:
            console.print(f"[{time.monotonic() - t0:5.0f} s] {done}/{total} {phase}", markup=False,
                          highlight=False, soft_wrap=True)

        line("starting the stack", 0, total)
        yield line
        line("done", total, total)
        return
    with Progress(
        TextColumn("{task.description:<44}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as bar:
        task = bar.add_task("starting the stack", total=total)

        def update(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total)

        yield update
        bar.update(task, completed=total, description="done")


def _report(
    console: Console, result: _Result, name: str, out_dir: Path, title: str,
    rows: Iterable[tuple[str, str]], examples: Iterable[str], *, as_json: bool,
) -> None:
    """Write the summary JSON, print the table, a few examples and the verdict (and the JSON line)."""
    summary = result.summary()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=2))
    table = Table("", "", title=title)
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    for line in examples:
        console.print(line)
    verdict = "improved" if result.improved else "no significant change"
    plot = f" · plot {result.plot}" if result.plot else ""
    console.print(f"  {verdict}{plot} · summary {out_dir / (name + '.json')}")
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
