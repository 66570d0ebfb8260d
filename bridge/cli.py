"""The `clawbridge` command line."""

import typer

app = typer.Typer(help="clawbridge: serve your agent's model, learn from every conversation.")


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as v

    typer.echo(v("clawbridge"))
