"""The `clawbridge` command line."""

from typing import Any

import typer

app = typer.Typer(help="clawbridge: serve your agent's model, learn from every conversation.")


def _default(name: str) -> Any:
    """A setting's default, for a flag's help: the settings declare it, the help never restates it."""
    from clawbridge.config import field_info

    return field_info(name).default


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
    g = s.gpus
    n = g.num_gpus if g.num_gpus is not None else layout.visible_gpus()
    try:
        p = layout.plan(n, g.actor_gpus, g.rollout_gpus, g.prm_gpus,
                        gpu_memory_gib=gpu_memory_gib, model_params_b=model_params_b, lora_rank=s.training.lora_rank)
    except layout.LayoutError as e:
        typer.echo(f"clawbridge plan: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(layout.render_plan(p, json=as_json))


# --- serving: up, export, sessions (the proxy engineer's commands) ------------------------------


@app.command("up")
def up_cmd(
    backend: str | None = typer.Option(None, help="local | tinker | fireworks | modal (default local)."),
    model: str | None = typer.Option(None, help="smollm2-135m-instruct (default, 32 K), smollm2-135m-instruct-8k, tiny-random, a local HF dir, or the platform's model."),
    host: str | None = typer.Option(None, help="Address to bind (default 127.0.0.1; any other needs --api-key)."),
    port: int | None = typer.Option(None, help="Port (default 30000; env PORT)."),
    api_key: str | None = typer.Option(None, "--api-key", help="Bearer key every request must carry (env CLAWBRIDGE_API_KEY)."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Store, adapters, logs (default ./.clawbridge)."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default SQLite in the data directory)."),
    served_model_name: str | None = typer.Option(None, help="Name /v1/models lists."),
    default_turn_type: str | None = typer.Option(None, help="Turn type of untagged requests: main | side."),
    train: bool | None = typer.Option(None, "--train/--no-train", help="Judge and train in the background."),
    config: str | None = typer.Option(None, "--config", help="Settings file (YAML or JSON)."),
    plan: bool = typer.Option(False, "--plan", help="Print the local GPU plan and exit without serving."),
    gpus: int | None = typer.Option(None, "--gpus", help="With --plan: GPU count to plan for."),
    as_json: bool = typer.Option(False, "--json", help="With --plan: print the plan as JSON."),
    method: str | None = typer.Option(None, help=f"binary | opd | combine (default {_default('method')})."),
    judge: str | None = typer.Option(None, "--judge", help="auto | rules | http | backend (default auto: http if --judge-url is set, else the offline rules judge)."),
    judge_url: str | None = typer.Option(None, "--judge-url", help="OpenAI-compatible judge endpoint (default: the offline rules judge)."),
    judge_model: str | None = typer.Option(None, "--judge-model", help="Judge model name at --judge-url."),
    judge_api_key: str | None = typer.Option(None, "--judge-api-key", help="Key for --judge-url (env CLAWBRIDGE_JUDGE_API_KEY)."),
    batch_size: int | None = typer.Option(None, "--batch-size", help=f"Samples per training step (default {_default('batch_size')})."),
    max_staleness: int | None = typer.Option(None, "--max-staleness", help="Drop samples drawn more than this many served versions ago."),
    learning_rate: float | None = typer.Option(None, "--lr", help=f"LoRA learning rate (default {_default('learning_rate'):g})."),
    resume: bool | None = typer.Option(None, "--resume/--no-resume", help="Continue from the latest checkpoint."),
    budget_usd: float | None = typer.Option(None, "--budget-usd", help="Stop training (never serving) at this spend."),
    print_settings: bool = typer.Option(False, "--print-settings", help="Print the settings this start would use (JSON, flat names) and the learning recipe beneath them, and exit."),
) -> None:
    """Serve the policy over the OpenAI API, capture every turn, learn in the background."""
    import logging
    from pathlib import Path

    from clawbridge.config import Settings, problems
    from pydantic import ValidationError

    if plan:
        plan_cmd(gpus=gpus, actor_gpus=None, rollout_gpus=None, prm_gpus=None,
                 gpu_memory_gib=80.0, model_params_b=4.0, as_json=as_json)
        return
    try:
        settings = Settings.load(
            Path(config) if config else None, backend=backend, model=model, host=host, port=port,
            api_key=api_key, data_dir=data_dir, db=db, served_model_name=served_model_name,
            default_turn_type=default_turn_type, train=train, method=method, judge=judge, judge_url=judge_url,
            judge_model=judge_model, judge_api_key=judge_api_key, batch_size=batch_size,
            max_staleness=max_staleness, learning_rate=learning_rate, resume=resume,
            budget_usd=budget_usd,
        )
    except ValidationError as e:
        typer.echo(f"clawbridge up: {problems(e)}", err=True)
        raise typer.Exit(2) from None
    except ValueError as e:  # a config file that is no mapping, or names a setting twice
        typer.echo(f"clawbridge up: {e}", err=True)
        raise typer.Exit(2) from None
    if print_settings:
        import json

        typer.echo(f"# learning recipe: {settings.recipe().describe()}", err=True)
        typer.echo(json.dumps(settings.flat(), indent=2, sort_keys=True, default=str))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("clawbridge").info("learning with %s; settings: clawbridge up --print-settings",
                                         settings.recipe().describe())
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migrations at open: not news
    from clawbridge import server
    from clawbridge.store import StoreInUse

    try:
        server.run(settings, **server.serving_extras(settings))
    except StoreInUse as e:  # a second process on one SQLite store
        typer.echo(f"clawbridge up: {e}", err=True)
        raise typer.Exit(1) from None


@app.command("export")
def export_cmd(
    fmt: str = typer.Option("jsonl", "--format", help="Only jsonl."),
    out: str | None = typer.Option(None, "--out", "-o", help="File to write (default stdout)."),
    data_dir: str | None = typer.Option(None, "--data-dir"),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default SQLite in the data directory)."),
    user: str | None = typer.Option(None, "--user", help="Only this user's sessions' turns (default: every user's)."),
) -> None:
    """Write every captured turn (ids, logprobs, next state, judgments) as JSON lines; with
    --user, only that user's (what they may take with them)."""
    import sys

    from clawbridge.config import Settings
    from clawbridge.store import Store

    if fmt != "jsonl":
        typer.echo("clawbridge export: only --format jsonl is supported", err=True)
        raise typer.Exit(2)
    settings = Settings.load(data_dir=data_dir, db=db)
    with Store.open(settings.db_url) as store:
        n = store.export_jsonl(out if out else sys.stdout, user=user)
    typer.echo(f"{n} turns exported" + (f" of {user}'s" if user else ""), err=True)


@app.command("export-model")
def export_model_cmd(
    version: str | None = typer.Option(None, "--version", help="The version to export: 3 or v3; 0 is the base model (default: the newest)."),
    out: str | None = typer.Option(None, "--out", "-o", help="Folder to create (default ./MODEL-vK): hf/ and gguf/ inside."),
    fmt: str = typer.Option("both", "--format", help="hf | gguf | both."),
    gguf_type: str = typer.Option("f16", "--gguf-type", help="GGUF tensor type: f32 | f16 | bf16."),
    data_dir: str | None = typer.Option(None, "--data-dir"),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default SQLite in the data directory)."),
    model: str | None = typer.Option(None, help="The base model the versions were trained on (default: the settings' model)."),
    adapter: str | None = typer.Option(None, "--adapter", help="Export this PEFT adapter folder instead of a version (e.g. one downloaded from Tinker or Modal)."),
    seed: int | None = typer.Option(None, help="tiny-random only: the seed its weights were made from."),
) -> None:
    """Merge a version's LoRA into its base and write a model that runs without clawbridge: a
    Hugging Face folder (transformers, vLLM) and a GGUF file with an Ollama Modelfile (llama.cpp,
    Ollama). Cloud versions: downloaded where the platform allows it (docs/export.md)."""
    from clawbridge.cli.export_model import run_export_model

    run_export_model(data_dir=data_dir, db=db, version=version, out=out, fmt=fmt, model=model,
                     gguf_type=gguf_type, adapter=adapter, seed=seed)


@app.command("sessions")
def sessions_cmd(
    limit: int = typer.Option(50, help="Most recent sessions to list."),
    data_dir: str | None = typer.Option(None, "--data-dir"),
    db: str | None = typer.Option(None),
) -> None:
    """A table of the captured sessions, newest first."""
    import sqlalchemy as sa
    from clawbridge.config import Settings
    from clawbridge.store import Store
    from clawbridge.store import schema as t
    from rich.console import Console
    from rich.table import Table

    settings = Settings.load(data_dir=data_dir, db=db)
    with Store.open(settings.db_url) as store, store.engine.connect() as conn:
        s = t.sessions.c
        rows = conn.execute(sa.select(t.sessions).order_by(s.updated_at.desc()).limit(limit)).all()
    table = Table("session", "source", "turns", "main", "done", "updated (UTC)")
    for r in rows:
        done = f"yes ({r.done_reason})" if r.done else "no"
        table.add_row(r.id, r.source, str(r.turns), str(r.main_turns), done, r.updated_at.strftime("%Y-%m-%d %H:%M:%S"))
    Console().print(table)


@app.command("ui")
def ui_cmd(
    data_dir: str | None = typer.Option(None, "--data-dir", help="The data directory to show (default ./.clawbridge)."),
    db: str | None = typer.Option(None, help="SQLAlchemy URL (default SQLite in the data directory)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (any other than loopback needs --api-key)."),
    port: int = typer.Option(30080, help="Port (0: any free one)."),
    api_key: str | None = typer.Option(None, "--api-key", help="Ask for this key before showing the page (env CLAWBRIDGE_API_KEY)."),
    user: str | None = typer.Option(None, "--user", help="Show this user's data alone (default: every user's)."),
) -> None:
    """The page of a finished run (`make demo`'s data directory), with no server running: what it
    recorded, read-only, no model loaded. A running server shows the same page at its own /ui."""
    from clawbridge.cli.status import checked_user
    from clawbridge.config import Settings
    from clawbridge.ui.live import serve_data_dir

    checked_user("ui", user)
    settings = Settings.load(data_dir=data_dir, db=db, api_key=api_key, host=host)
    if settings.db is None and not (settings.data_dir / "clawbridge.db").exists():
        typer.echo(f"clawbridge ui: no store in {settings.data_dir} (run `clawbridge up` or `make demo` first, "
                   "or pass --data-dir)", err=True)
        raise typer.Exit(1)
    serve_data_dir(settings, host, port, started=lambda url: typer.echo(f"clawbridge ui: open {url}  (Ctrl-C to stop)"),
                   user=user)


# --- learning: demo, status, versions (the learning loop's commands) ----------------------------


@app.command("demo")
def demo_cmd(
    scenario: str = typer.Option("concise", "--scenario", help="A built-in scenario (concise, one_sentence, tools, two_users) or a YAML/JSON file."),
    model: str | None = typer.Option(None, help="Model (default: the embedded smollm2-135m-instruct)."),
    method: str | None = typer.Option(None, help="binary | opd | combine (default: the scenario's)."),
    rounds: int | None = typer.Option(None, help="Training steps (default: the scenario's)."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Default: a fresh temporary directory."),
    out: str = typer.Option("demo-results", "--out", help="Where the PNG and the JSON summary go."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON summary on stdout (progress goes to stderr)."),
    seed: int = typer.Option(0, help="Sampling and LoRA seed."),
    print_settings: bool = typer.Option(False, "--print-settings", help="Print the settings the scenario's recipe makes (by flat name, JSON) and exit."),
    instant: bool = typer.Option(False, "--instant", help="Serve the user's preference at once as an instruction, as `clawbridge up` does, and measure two curves: as served and the weights alone (docs/learning.md#clawbridge-demo)."),
    control: bool = typer.Option(False, "--control", help="two_users: run each user again alone on a fresh server, to measure the crosstalk against (triples the time)."),
) -> None:
    """Watch the model learn: a simulated user with a hidden preference talks to clawbridge over
    the OpenAI API; clawbridge judges, trains and publishes; held-out prompts show the change."""
    from clawbridge.cli.demo import run_demo_command

    run_demo_command(scenario, model=model, method=method, rounds=rounds, data_dir=data_dir,
                     out=out, as_json=as_json, seed=seed, print_settings=print_settings, instant=instant,
                     control=control)


@app.command("status")
def status_cmd(
    data_dir: str | None = typer.Option(None, "--data-dir"),
    db: str | None = typer.Option(None),
    user: str | None = typer.Option(None, "--user", help="This user's sessions, turns, samples and preferences alone."),
) -> None:
    """Captured turns, judged turns, samples by state, training steps and the newest version;
    with --user, that user's, their own adapter's steps, versions and gate included."""
    from clawbridge.cli.status import checked_user, print_status

    print_status(data_dir, db, checked_user("status", user))


@app.command("versions")
def versions_cmd(
    data_dir: str | None = typer.Option(None, "--data-dir"),
    db: str | None = typer.Option(None),
    user: str | None = typer.Option(None, "--user", help="This user's own adapter's versions alone."),
) -> None:
    """A table of policy versions: version, (whose,) step, samples, mean reward, gate, when."""
    from clawbridge.cli.status import checked_user, print_versions

    print_versions(data_dir, db, checked_user("versions", user))


@app.command("rollback")
def rollback_cmd(
    version: str = typer.Argument(..., help="The version to serve again: 3 or v3 (0: the base model)."),
    url: str = typer.Option("http://127.0.0.1:30000", "--url", help="The running clawbridge server."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="CLAWBRIDGE_API_KEY", help="The server's bearer key."),
) -> None:
    """Serve an earlier version again: the running server publishes its weights as a new version
    (versions only go up), and training continues from them."""
    from clawbridge.cli.status import request_rollback

    request_rollback(url, version, api_key)


# --- OpenClaw: config, install (the integration engineer's commands) ------------------------------

from clawbridge.cli.preferences import preferences_app  # noqa: E402 - beside the other sub-commands
from clawbridge.cli.spool import spool_app  # noqa: E402
from clawbridge.cli.users import users_app  # noqa: E402

app.add_typer(preferences_app, name="preferences")
app.add_typer(spool_app, name="spool")
app.add_typer(users_app, name="users")

openclaw_app = typer.Typer(help="Use clawbridge as an OpenClaw model provider (docs/openclaw.md).")
app.add_typer(openclaw_app, name="openclaw")


def _server_model(url: str, api_key: str | None) -> dict:
    """The running server's /v1/models entry (its model, context and suggested budget)."""
    import httpx

    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{root}/v1/models", headers=headers, timeout=5)
    r.raise_for_status()
    return dict(r.json()["data"][0])


OPENCLAW_PROMPT_TOKENS = 14_000  # its system prompt and 12 tools: 13.3-14.5 K tokens, measured


def _openclaw_provider(url: str, model: str | None, api_key: str | None, context_window: int | None,
                       max_tokens: int | None, keyed: bool | None) -> dict:
    """The provider entry, sized by the server it points at: its model, its context window and
    the completion budget it suggests (a CPU server suggests a short one). Flags override."""
    from clawbridge.openclaw.provider import provider_entry

    card: dict = {}
    if model is None or context_window is None or max_tokens is None:
        try:
            card = _server_model(url, api_key)
        except Exception as e:
            if model is None:
                typer.echo(f"clawbridge openclaw: cannot ask {url} for its model ({e}). Start "
                           "`clawbridge up` first, pass --url if it runs elsewhere (another port or "
                           "host), or give --model, --context-window and --max-tokens yourself", err=True)
                raise typer.Exit(2) from None
    model = model or str(card["id"])
    context_window = context_window or int(card.get("max_model_len") or FALLBACK_CONTEXT)
    max_tokens = max_tokens or int(card.get("suggested_max_tokens") or FALLBACK_MAX_TOKENS)
    return provider_entry(url, model, context_window=context_window, max_tokens=max_tokens,
                          keyed=bool(api_key) if keyed is None else keyed)


FALLBACK_CONTEXT, FALLBACK_MAX_TOKENS = 32768, 512  # a server that does not say (not clawbridge)
_URL = typer.Option("http://127.0.0.1:30000", "--url", help="The clawbridge server (default: `clawbridge up`'s).")
_MODEL = typer.Option(None, "--model", help="Model id (default: ask the server's /v1/models).")
_KEY = typer.Option(None, "--api-key", envvar="CLAWBRIDGE_API_KEY", help="Key to ask the server with (never written to openclaw.json).")
_CTX = typer.Option(None, "--context-window", help="Context window OpenClaw plans prompts for (default: the server's).")
_MAXTOK = typer.Option(None, "--max-tokens", help="Completion budget OpenClaw asks for (default: what the server suggests; 128 on CPU).")
_KEYED = typer.Option(None, "--keyed/--no-keyed", help="Reference ${CLAWBRIDGE_API_KEY} as the provider key (default: when a key is given).")


@openclaw_app.command("config")
def openclaw_config_cmd(
    url: str = _URL, model: str | None = _MODEL, api_key: str | None = _KEY,
    context_window: int | None = _CTX, max_tokens: int | None = _MAXTOK, keyed: bool | None = _KEYED,
) -> None:
    """Print the openclaw.json fragment that makes clawbridge a provider (and the default model)."""
    import json

    from clawbridge.openclaw.provider import fragment

    provider = _openclaw_provider(url, model, api_key, context_window, max_tokens, keyed)
    typer.echo(json.dumps(fragment(provider, None), indent=2))


@openclaw_app.command("install")
def openclaw_install_cmd(
    url: str = _URL, model: str | None = _MODEL, api_key: str | None = _KEY,
    context_window: int | None = _CTX, max_tokens: int | None = _MAXTOK, keyed: bool | None = _KEYED,
    openclaw_home: str | None = typer.Option(None, "--openclaw-home", envvar="OPENCLAW_HOME", help="OpenClaw's home (default: your home directory)."),
    set_default: bool = typer.Option(True, "--default/--no-default", help="Make clawbridge OpenClaw's default model."),
    plugin: bool = typer.Option(True, "--plugin/--no-plugin", help="Install and enable the clawbridge plug-in."),
) -> None:
    """Add clawbridge to openclaw.json (the old file is backed up) and install the plug-in."""
    from pathlib import Path

    from clawbridge.openclaw.provider import OpenClawConfigError, install

    provider = _openclaw_provider(url, model, api_key, context_window, max_tokens, keyed)
    home = Path(openclaw_home).expanduser() if openclaw_home else Path.home()
    try:
        r = install(home, provider, set_default=set_default, with_plugin=plugin)
    except OpenClawConfigError as e:
        typer.echo(f"clawbridge openclaw install: {e}", err=True)
        raise typer.Exit(2) from None
    if r.changed:
        typer.echo(f"updated {r.config_path}" + (f" (previous file: {r.backup})" if r.backup else ""))
    else:
        typer.echo(f"{r.config_path} already up to date")
    spec = provider["models"][0]
    typer.echo(f"provider clawbridge/{spec['id']} at {provider['baseUrl']}: contextWindow "
               f"{spec['contextWindow']}, maxTokens {spec['maxTokens']}")
    if spec["contextWindow"] < OPENCLAW_PROMPT_TOKENS:
        typer.echo(f"warning: OpenClaw's own prompt is about {OPENCLAW_PROMPT_TOKENS:,} tokens and this model reads "
                   f"{spec['contextWindow']:,}: its turns will be refused (context_length_exceeded). Serve a longer "
                   "context: plain `clawbridge up` serves the embedded model at 32 K (docs/openclaw.md).", err=True)
    if plugin:
        typer.echo(f"plug-in {'installed' if r.plugin_changed else 'unchanged'} at {r.plugin_dir}")
    if provider["apiKey"].startswith("${"):
        typer.echo("OpenClaw reads the key from CLAWBRIDGE_API_KEY: export it where OpenClaw runs")


# --- cloud backends: doctor, modal deploy (the cloud engineer's commands) -------------------------


@app.command("doctor")
def doctor_cmd(
    backend: str | None = typer.Option(None, help="tinker | fireworks | modal (default: all cloud backends)."),
) -> None:
    """Check installed extras and cloud credentials (no network, no money spent)."""
    import os
    from pathlib import Path

    from clawbridge.backends import doctor

    checks = doctor.run_checks(os.environ, Path.home(), backend)
    typer.echo(doctor.report(checks))
    if backend and backend != "local" and not doctor.ready(checks, backend):
        typer.echo(f"\n{backend}: not ready (see NO lines above)", err=True)
        raise typer.Exit(1)


modal_cli = typer.Typer(help="Run the training engine on Modal GPUs (docs/backends.md).")
app.add_typer(modal_cli, name="modal")


@modal_cli.command("deploy")
def modal_deploy_cmd(
    gpu: str = typer.Option("H100", help="Modal GPU type of the engine class (H100, A100-80GB, L40S, ...)."),
    name: str = typer.Option("clawbridge", help="App name (`--modal-app` of `clawbridge up`)."),
) -> None:
    """Deploy the engine class (`clawbridge.backends.modal_app`) as a persistent Modal app."""
    import os
    from pathlib import Path

    from clawbridge.backends import doctor

    checks = doctor.run_checks(os.environ, Path.home(), "modal")
    if not doctor.ready(checks, "modal"):
        typer.echo(doctor.report(checks), err=True)
        raise typer.Exit(1)
    os.environ["CLAWBRIDGE_MODAL_GPU"] = gpu  # read once when the app module defines the class
    import modal
    from clawbridge.backends import modal_app

    with modal.enable_output():
        modal_app.app.deploy(name=name)
    typer.echo(f"deployed {name} (Engine on {gpu}); serve with: clawbridge up --backend modal")
