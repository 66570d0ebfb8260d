"""The `clawbridge` command line."""

import typer

app = typer.Typer(help="clawbridge: serve your agent's model, learn from every conversation.")


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as v

    typer.echo(v("clawbridge"))


@app.command("plan")
def plan_cmd(
    gpus: int | None = typer.Option(None, "--gpus", envvar="NUM_GPUS", help="GPU count to plan for (default: the visible GPUs)."),
    actor_gpus: int | None = typer.Option(None, envvar="ACTOR_GPUS", help="GPUs for the FSDP2 trainer."),
    rollout_gpus: int | None = typer.Option(None, envvar="ROLLOUT_GPUS", help="GPUs for the policy SGLang server."),
    prm_gpus: int | None = typer.Option(None, envvar="PRM_GPUS", help="GPUs for the judge SGLang server (0: share the policy server)."),
    gpu_memory_gib: float = typer.Option(80.0, help="Memory per GPU for the budget."),
    model_params_b: float = typer.Option(4.0, help="Base model size in billions of parameters."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Print the local GPU plan (processes, GPUs, ports, memory per GPU) without starting anything."""
    from clawbridge.config import Settings
    from clawbridge.local_gpu import layout

    s = Settings.load(num_gpus=gpus, actor_gpus=actor_gpus, rollout_gpus=rollout_gpus, prm_gpus=prm_gpus)
    n = s.num_gpus if s.num_gpus is not None else layout.visible_gpus()
    try:
        p = layout.plan(n, s.actor_gpus, s.rollout_gpus, s.prm_gpus,
                        gpu_memory_gib=gpu_memory_gib, model_params_b=model_params_b, lora_rank=s.lora_rank)
    except layout.LayoutError as e:
        typer.echo(f"clawbridge plan: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(layout.render_plan(p, json=as_json))
