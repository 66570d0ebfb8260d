"""The composition root: backend + store + proxy (+ the learning loop) under uvicorn, background
tasks, banner, status line, and a clean, fast stop on SIGTERM or Ctrl-C: uvicorn stops
accepting, the streams in flight finish or are ended after `shutdown_grace_s`, the learner is
cancelled (its judging, scoring or step abandoned: the store holds every turn, and a sample is
`trained` only in its step's commit, so nothing is lost or trained twice), the store flushes
its writer and the backend closes (the engine abandons the forward it is in between chunks).

Everything is built once, here, and handed to the parts that use it: one renderer (the proxy,
the judges, the teacher, the gate), one teacher scorer (the collector, the episodes, the hint
judge), the judges and the gate (`build_learning`). Serving and learning never import each
other: the learner's routes, wake-up and status fields go to the proxy as `ProxyHooks`, its loop
runs as a background task."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import uvicorn
from clawbridge.chat.renderer import Renderer
from clawbridge.judges import Teacher, build_judges
from clawbridge.judges.pairwise import PairwiseJudge
from clawbridge.learning import preferences
from clawbridge.learning.baking import Retirement, Twin
from clawbridge.learning.collector import Collector
from clawbridge.learning.episodes import EpisodeLearner
from clawbridge.learning.gate import Gate, GateProbe, probe_scorer
from clawbridge.learning.gate_rules import GENERAL
from clawbridge.learning.learner import Learner, LearningParts
from clawbridge.learning.lease import Coordinator
from clawbridge.learning.lineages import UserLineages, settle_start
from clawbridge.learning.probes import Probe, gate_tiers, general_probes
from clawbridge.learning.promotion import Resumed, pin_interrupted, resume
from clawbridge.learning.trainer import Trainer
from clawbridge.routes import (
    SPOOL_HANDLERS,
    episode_routes,
    feedback_route,
    preference_routes,
    rollback_route,
    user_routes,
)
from clawbridge.serving import anthropic, completions, metrics, responses
from clawbridge.serving.app import create_app
from clawbridge.serving.instructing import REFRESH_S
from clawbridge.serving.proxy import Proxy, ProxyHooks
from clawbridge.store.records import DEFAULT_USER
from clawbridge.types import SamplingParams
from clawbridge.ui import ui_routes
from clawbridge.ui.live import live_board

if TYPE_CHECKING:
    from clawbridge.config import GateSettings, Settings
    from clawbridge.protocol import Backend
    from clawbridge.store import Preference, Store

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0005
# The wire formats served beside chat completions, over the same admission and capture.
SURFACES = (responses.routes, anthropic.routes, completions.routes)


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT/SIGTERM once it has drained, which would kill the
    process (SIGTERM) or cancel `serve` (SIGINT) before the store is flushed and the background
    tasks are stopped. `serve` finishes the shutdown itself, so the signal is not re-raised."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


@dataclass
class Running:
    """What a background task gets: the live pieces of the server."""

    settings: Settings
    backend: Backend
    store: Store
    proxy: Proxy
    renderer: Renderer  # the one renderer: messages <-> tokens for the proxy and the learner
    base_url: str
    server: uvicorn.Server  # set `server.should_exit = True` to drain and stop
    # several proxies on one store (PostgreSQL): the trainer lease and the serving version
    coordinator: Coordinator | None = None
    resumed: Resumed | None = None  # what `resume` loaded before the first request
    lineages: UserLineages | None = None  # each user's own adapter (docs/learning.md#each-user-their-own-adapter)


BackgroundTask = Callable[[Running], Coroutine[Any, Any, None]]


def learner_hooks(learner: Learner) -> ProxyHooks:
    """How the proxy reaches the learner: its two routes, a wake-up on every next state, and the
    fields of the status line and /metrics."""
    return ProxyHooks(
        routes=[feedback_route(learner.wake), rollback_route(learner), *episode_routes(learner.wake),
                *preference_routes(learner), *user_routes(learner), *ui_routes(live_board(learner))],  # the page at /ui (docs/ui.md)
        on_next_state=lambda _ns: learner.wake.set(),
        status_extra=learner.status,
        metrics_extra=learner.metrics,
        spool_handlers=SPOOL_HANDLERS,
    )


def learner_task(learner: Learner) -> BackgroundTask:
    async def learn(running: Running, resumed: Resumed | None) -> None:
        learner.on_preferences = serves_preferences(running.proxy)  # a preference heard is served at once
        bind_learner(learner, running.backend, running.store, running.renderer, resumed=resumed,
                     lineages=running.lineages)
        await learner.run()

    async def run(running: Running) -> None:
        coordinator = running.coordinator
        if coordinator is None:
            return await learn(running, running.resumed)

        learner.elsewhere = coordinator.elsewhere  # a rollback only where the lease is held

        async def take_over() -> None:  # the store moved on while another process trained
            resumed = await resume(running.backend, running.store)
            if running.lineages is not None:
                await settle_start(running.lineages, resumed)
            await learn(running, resumed)

        await coordinator.lead(take_over)

    return run


def bind_learner(learner: Learner, backend: Backend, store: Store, renderer: Renderer | None = None, *,
                 resumed: Resumed | None = None, lineages: UserLineages | None = None) -> None:
    """Build the learner's parts on the live backend and store and bind them. `renderer`: the
    server's own (`Running.renderer`); a new one only where no server runs (tools, tests).
    `resumed`: what `resume` loaded at the start (None: a fresh optimizer). `lineages`: the
    server's users' lineages (None: one lineage, every user's samples on one adapter)."""
    learner.bind(build_learning(learner.settings, backend, store, renderer or Renderer(backend.tokenizer()),
                                lock=learner.lock, probes=learner.extra_probes, resumed=resumed,
                                on_preferences=learner.on_preferences, lineages=lineages))


def build_learning(
    settings: Settings, backend: Backend, store: Store, renderer: Renderer, *,
    lock: asyncio.Lock | None = None, probes: Sequence[GateProbe] = (), resumed: Resumed | None = None,
    on_preferences: Callable[[str, Sequence[Preference]], None] | None = None,
    lineages: UserLineages | None = None,
) -> LearningParts:
    """The learner's parts, each built once: the teacher scorer shared by the collector, the
    episodes and (`hint_selection = overlap`) the hint judge; the judges; the gate with the
    judge model's pairwise comparison when there is one; the trainer that runs it, which goes on
    from what `resume` loaded (`resumed`: a checkpoint brought the optimizer's moments back).
    With `lineages`, each user's trainer is built the same way on their lineage when they first
    have a batch (`make_trainer`); the gate, judges and teacher are everyone's."""
    learning, training = settings.learning, settings.training
    teacher = Teacher(backend, renderer, model=training.teacher, clip=learning.opd_clip)
    judging = settings.judging
    judges = build_judges(judging, backend, seed=settings.seed, renderer=renderer,
                          teacher=teacher if judging.hint_selection == "overlap" else None)
    client = getattr(judges.reward, "client", None)  # a judge model (the rules judge has none)
    # the trainer hands the gate gate_recent of a batch's prompts to compare pairwise: none, no comparison
    pairwise = PairwiseJudge(client, seed=settings.seed) if client is not None and training.gate_recent else None
    gate = build_gate(settings.gating, backend, renderer, pairwise, probes, seed=settings.seed)
    lock = lock or asyncio.Lock()  # every lineage's steps share it: one trainable adapter at a time

    def trainer_on(lineage_backend: Backend, lineage_store: Store, resumed: Resumed | None) -> Trainer:
        return Trainer(settings.training, lineage_backend, lineage_store, lock=lock, gate=gate, teacher=teacher,
                       resumed=resumed, redraw_max_tokens=learning.redraw_max_tokens,
                       retirement=build_retirement(settings.gating, lineage_backend, renderer, seed=settings.seed)
                       if settings.serving.instant_preferences else None)

    if lineages is None:
        trainer = trainer_on(backend, store, resumed)
        backend_of: Callable[[str], Backend] = lambda _user: backend  # noqa: E731
    else:
        lineages.make_trainer = lambda lineage: trainer_on(
            lineage.backend, lineage.store, resumed if lineage.user == DEFAULT_USER else None)  # type: ignore[arg-type]
        trainer = lineages.trainer(lineages.default)
        backend_of = lambda user: lineages.get(user).backend  # noqa: E731
    return LearningParts(
        judges=judges,
        collector=Collector(learning, backend, store, judges, teacher, method=training.method,
                            on_preferences=on_preferences, distils_topk=training.opd_topk > 0, backend_of=backend_of),
        episodes=EpisodeLearner(learning, backend, store, judges, teacher, method=training.method),
        trainer=trainer,
        lineages=lineages,
    )


def build_retirement(settings: GateSettings, backend: Backend, renderer: Renderer, *, seed: int) -> Retirement:
    """What retires an applied preference's instruction once the weights carry it (`baking`): the
    twin answers the user's recent prompts as the gate's probes are answered."""
    params = SamplingParams(max_tokens=settings.gate_max_tokens, temperature=settings.gate_temperature, seed=seed)
    return Retirement(Twin(backend, renderer, params, settings.retire_samples), settings.retire_share,
                      settings.restore_share)


def serves_preferences(proxy: Proxy) -> Callable[[str, Sequence[Preference]], None]:
    """What the collector calls when a hearing changed a user's preferences: the proxy serves
    that user the applied ones from their next request on (docs/serving.md#the-users-preferences)."""
    def changed(user: str, prefs: Sequence[Preference]) -> None:
        proxy.standing.set(user, preferences.served_instruction(prefs))

    return changed


def build_gate(
    settings: GateSettings, backend: Backend, renderer: Renderer,
    pairwise: PairwiseJudge | None = None, extra: Sequence[GateProbe] = (), *, seed: int,
) -> Gate | None:
    """The gate the settings ask for: a spread of the general probe set plus the caller's
    probes (`extra`), and with a judge model the user's recent prompts compared pairwise (the
    offline rules judge cannot compare two answers). None: the gate is off or has nothing to ask."""
    s = settings
    if s.gate == "off":
        return None
    chosen, rest = gate_tiers(general_probes(), s.gate_probes, s.gate_probes_max)

    def ask(qs: list[Probe]) -> list[GateProbe]:
        return [GateProbe(GENERAL, ({"role": "user", "content": p.question},), probe_scorer(p.key.answered))
                for p in qs]

    probes = ask(chosen) + list(extra)
    if not probes and pairwise is None:
        return None
    params = SamplingParams(max_tokens=s.gate_max_tokens, temperature=s.gate_temperature, seed=seed)
    return Gate(backend, renderer, probes, params=params, samples=s.gate_samples,
                reference_samples=s.gate_reference_samples, margin=s.gate_margin, alpha=s.gate_alpha,
                alpha_base=s.gate_alpha_base, reference=s.gate_reference, max_price=s.gate_max_price,
                non_inferiority=s.gate_v0_test == "non_inferiority", pairwise=pairwise,
                reserve=ask(rest))


def serving_extras(settings: Settings) -> dict[str, Any]:
    """What `clawbridge up` adds to the server: the learning loop, when training is on
    (`{"hooks": ..., "background": [...]}` for `serve`); without it `up` serves and captures."""
    if not settings.train:  # the page still shows what is captured (docs/ui.md)
        return {"hooks": ProxyHooks(routes=[*preference_routes(), *user_routes(), *ui_routes(live_board(None))])}
    learner = Learner(settings)
    return {"hooks": learner_hooks(learner), "background": [learner_task(learner)]}


def build_backend(settings: Settings) -> Backend:
    """The backend the settings name. Imported lazily: each platform pulls its own SDK."""
    if settings.backend == "local":  # CPU, CUDA or the SGLang + FSDP2 stack, by the machine
        from clawbridge.backends.local_stack import build_local

        return build_local(settings)
    import importlib

    mod = importlib.import_module(f"clawbridge.backends.{settings.backend}")
    return mod.from_settings(settings)  # type: ignore[no-any-return]


def open_store(settings: Settings) -> Store:
    from clawbridge.store import Store
    from clawbridge.store.base import private_dir

    private_dir(settings.data_dir)  # 0700: every conversation is in it (docs/privacy.md)
    return Store.open(settings.db_url)


def banner(settings: Settings, backend: Backend, proxy: Proxy, base_url: str) -> str:
    keyed = settings.serving.api_key is not None
    auth = ' -H "Authorization: Bearer $CLAWBRIDGE_API_KEY"' if keyed else ""
    body = json.dumps({"model": proxy.model_name, "messages": [{"role": "user", "content": "Hello!"}]})
    card = proxy.model_card()
    install = "clawbridge openclaw install"
    if base_url != "http://127.0.0.1:30000":
        install += f" --url {base_url}"
    return "\n".join(
        [
            f"clawbridge serving {proxy.model_name} ({backend.name} backend, "
            + (f"{card['dtype']}, " if "dtype" in card else "")  # the engine's compute dtype
            + f"policy@v{backend.version})",
            f"  endpoint  {base_url}/v1",
            f"  page      {base_url}/ui",
            f"  context   {card['max_model_len']} tokens (suggested max_tokens {card['suggested_max_tokens']})",
            f"  data      {settings.data_dir}",
            "",
            "Try it:",
            f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
            f"    -d '{body}'",
            "",
            "OpenClaw (Node >= 24.16, `npm install -g openclaw`), in another terminal:",
            f"  {install}",
            "  (adds the provider and plug-in to $OPENCLAW_HOME/.openclaw/openclaw.json, default",
            "  ~/.openclaw/openclaw.json, after a backup; docs/openclaw.md)",
            "",
        ]
    )


def status_line(status: dict[str, Any]) -> str:
    store = status.get("store", {})
    parts = [
        f"requests {status['requests']}",
        f"in flight {status['in_flight']}",
        f"sessions {status['sessions_open']}",
        f"turns captured {store.get('turns', status['turns_recorded'])}",
        f"policy@v{status['version']}",
    ]
    spool = status.get("spool", {})
    if spool.get("depth"):  # writes waiting for the store (serving.durable)
        parts.append(f"spooled {spool['depth']} ({spool['state']})")
    extra = status.get("extra")  # the learning loop's fields (hooks.status_extra)
    if isinstance(extra, dict):
        parts += [f"{k} {v}" for k, v in extra.items()]
    return " · ".join(parts)


def _with_trainer(
    coordinator: Coordinator, extra: Callable[[], dict[str, Any]] | None
) -> Callable[[], dict[str, Any]]:
    """The status fields with which process trains (several proxies on one store)."""
    return lambda: {**coordinator.status(), **(extra() if extra else {})}


async def _status_loop(proxy: Proxy, every_s: float, tty: bool) -> None:
    last = 0.0
    while True:
        await asyncio.sleep(every_s)
        line = status_line(await metrics.status(proxy))
        if tty:
            sys.stdout.write("\r\x1b[2K" + line)
            sys.stdout.flush()
        elif time.monotonic() - last > 60:
            log.info("%s", line)
            last = time.monotonic()


async def _standing_loop(proxy: Proxy, every_s: float) -> None:
    """The served instruction read again from the store: what another proxy on a shared store
    (or `clawbridge preferences` against it) changed is served here within `every_s`."""
    while True:
        await asyncio.sleep(every_s)
        await proxy.standing.refresh()


async def _expire_loop(proxy: Proxy, every_s: float) -> None:
    store = proxy.store
    while True:
        await asyncio.sleep(every_s)
        idle = proxy.sessions.expire()
        if idle and store.shared:  # another proxy on the store may have served them since
            cutoff = datetime.now(UTC) - timedelta(seconds=proxy.sessions.idle_timeout_s)
            stale = set(await store.run(store.idle_sessions, cutoff))
            idle = [sid for sid in idle if sid in stale]
        for sid in idle:
            await proxy.close_session(sid, "idle")


async def serve(
    settings: Settings,
    *,
    backend: Backend | None = None,
    store: Store | None = None,
    hooks: ProxyHooks | None = None,
    background: Sequence[BackgroundTask] = (),
    quiet: bool = False,
    started: Callable[[Running], None] | None = None,
    freeze_gc: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM, then drain. Background tasks run beside the server and are
    cancelled once the last in-flight request is answered. `freeze_gc`: exempt everything built
    so far from garbage collection (for a process that serves until it exits; `run` sets it)."""
    # The store's writer thread and the engine thread run Python too; with the default 5 ms
    # GIL switch interval the event loop waits up to 5 ms each time one of them holds the GIL,
    # several times a request. A short interval keeps the loop responsive.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    backend = backend or build_backend(settings)
    await backend.start()
    if store is None:
        store = await asyncio.to_thread(open_store, settings)
        store.claim_serving()  # SQLite: one serving process (docs/scale-out.md)
    # Before the first request: the newest version the store recorded serves, and training goes
    # on from it (versions are append-only; docs/operating.md, "Restarts"), trained or not.
    resumed = await resume(backend, store)
    # each user's own lineage of versions, served by their own (docs/learning.md#each-user-their-own-adapter)
    lineages = UserLineages(backend, store)
    await settle_start(lineages, resumed)
    if settings.train and settings.gating.gate != "off":
        # a restart that interrupted the gate: the version that served then serves until the
        # learner has settled it (`Promotion.recover`), each user's apart
        for lineage in list(lineages.by_user.values()):
            await pin_interrupted(lineage.backend, lineage.store)  # type: ignore[arg-type]
    coordinator = Coordinator(store, backend, train=settings.train, lineages=lineages) if store.shared else None
    if coordinator is not None:
        await coordinator.start()  # the lease, or the version the trainer serves
    renderer = Renderer(backend.tokenizer())
    app = create_app(settings, backend, store, hooks, renderer=renderer, surfaces=SURFACES)
    proxy: Proxy = app.state.proxy
    proxy.lineages = lineages
    if coordinator is not None:
        proxy.hooks.status_extra = _with_trainer(coordinator, proxy.hooks.status_extra)

    async def applied() -> dict[str, str]:  # each user's instruction, the most recently applied first
        return preferences.served_by_user(await store.run(store.all_preferences, ("applied",)))

    proxy.standing.source = applied
    await proxy.standing.refresh()
    # what a previous run spooled goes in first, so the sessions read back include it
    await proxy.durable.start()
    await proxy.restore_sessions()  # open conversations continue across a restart
    if freeze_gc:
        # Everything alive now (torch, transformers, the model, the tokenizer: millions of
        # objects) lives as long as the server. Left to the collector, each full collection
        # walks all of it and stalls every request for 20–100 ms; frozen, it is never scanned.
        gc.collect()
        gc.freeze()
    config = uvicorn.Config(
        app,
        host=settings.serving.host,
        port=settings.serving.port,
        log_level="warning",
        lifespan="off",
        access_log=False,
        # on SIGTERM/SIGINT the streams in flight finish, or are cancelled after this grace
        timeout_graceful_shutdown=max(1, round(settings.serving.shutdown_grace_s)),
        http="httptools",
        loop="uvloop",
        proxy_headers=False,  # nothing reads the client address; the middleware costs every request
        # uvicorn closes an idle keep-alive connection after 5 s by default, the same idle time
        # after which httpx (the openai SDK) drops a pooled one: a request sent on a connection
        # the server is closing fails with a connection error when the client does not retry.
        # Outlasting every common pool makes the client, never the server, close idle ones; the
        # Keep-Alive header tells the clients that read it (undici, urllib3) when we would.
        timeout_keep_alive=int(settings.serving.keep_alive_s),
        headers=[("keep-alive", f"timeout={int(settings.serving.keep_alive_s)}")],
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():  # e.g. the port is taken: uvicorn exits before it starts
            await serving
            raise SystemExit(1)
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    host = "127.0.0.1" if settings.serving.host in ("0.0.0.0", "::") else settings.serving.host
    base_url = f"http://{host}:{port}"
    running = Running(settings, backend, store, proxy, renderer, base_url, server, coordinator, resumed, lineages)
    if not quiet:
        print(banner(settings, backend, proxy, base_url), flush=True)
        if coordinator is not None:
            print(coordinator.describe(), flush=True)
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(t(running)) for t in background]
    if coordinator is not None:
        tasks.append(asyncio.create_task(coordinator.run()))
    tasks.append(asyncio.create_task(_expire_loop(proxy, min(60.0, settings.serving.session_idle_timeout_s / 4))))
    tasks.append(asyncio.create_task(_standing_loop(proxy, REFRESH_S)))
    if not quiet:
        tasks.append(asyncio.create_task(_status_loop(proxy, 1.0, sys.stdout.isatty())))
    if started is not None:
        started(running)
    try:
        await serving
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not quiet and sys.stdout.isatty():
            print()
        await proxy.durable.close()  # what it still holds is replayed at the next start
        await asyncio.to_thread(store.close)  # drains the group-commit writer
        await backend.close()
        log.info("clawbridge stopped: %d requests, %d turns", proxy.counters.requests, proxy.counters.turns_recorded)


def run(settings: Settings, **kw: Any) -> None:
    """Blocking entry point for the CLI."""
    try:
        import uvloop

        uvloop.run(serve(settings, freeze_gc=True, **kw))
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        asyncio.run(serve(settings, freeze_gc=True, **kw))
    except KeyboardInterrupt:  # a second Ctrl-C during the drain: uvicorn forced the exit
        pass
