"""What the server says of itself: Prometheus exposition of the proxy's counters (and the learning
loop's gauges, through a hook) for machines, the status JSON (`/v1/status`) for people."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from clawbridge.protocol import NamesItsDtype
from clawbridge.serving.users import OPERATOR, Caller

if TYPE_CHECKING:
    from clawbridge.serving.proxy import Proxy


class _ExtraGauges:
    """A Prometheus collector over a hook's numbers, read at scrape time."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        for name, value in self.read().items():
            yield GaugeMetricFamily(f"clawbridge_{name}", name.replace("_", " "), value=float(value))

    def describe(self) -> list[Any]:
        return []  # values appear at scrape time; nothing to check at registration


class Metrics:
    """Prometheus exposition on a registry of its own (several apps may live in one process)."""

    def __init__(self, proxy: Proxy) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self._by_status: dict[int, Any] = {}
        self.requests = Counter(
            "clawbridge_requests", "Chat completion requests by status", ["status"], registry=self.registry
        )
        self.latency = Histogram(
            "clawbridge_request_seconds", "Time to the response headers (stream) or body",
            registry=self.registry,
        )
        c = proxy.counters

        def spool(key: str) -> float:
            return float(proxy.durable.status()[key])

        for name, doc, fn in (
            ("clawbridge_in_flight", "Requests being answered", lambda: c.in_flight),
            ("clawbridge_turns_recorded", "Turns committed to the store", lambda: c.turns_recorded),
            ("clawbridge_record_failures", "Turns neither stored nor spooled (lost)", lambda: c.record_failures),
            ("clawbridge_turns_spooled", "Turns written to the spool while the store could not take them",
             lambda: c.turns_spooled),
            ("clawbridge_store_up", "1 while the store takes writes, 0 while writes spool",
             lambda: float(proxy.durable.down_since is None)),
            ("clawbridge_spool_depth", "Writes in the spool not yet replayed", lambda: proxy.durable.depth),
            ("clawbridge_spool_bytes", "Bytes of the spool not yet replayed", lambda: spool("bytes")),
            ("clawbridge_spool_oldest_age_seconds", "Age of the oldest write in the spool",
             lambda: spool("oldest_age_s")),
            ("clawbridge_spool_replayed", "Spooled writes that reached the store", lambda: proxy.durable.replayed),
            ("clawbridge_turns_lost", "Turns never stored (spool full, or dropped on replay)",
             lambda: spool("turns_lost")),
            ("clawbridge_writes_lost", "Writes of any kind never stored", lambda: spool("writes_lost")),
            ("clawbridge_completion_tokens", "Tokens generated", lambda: c.completion_tokens),
            ("clawbridge_sessions_open", "Sessions being tracked", lambda: len(proxy.sessions)),
            ("clawbridge_policy_version", "The version the default user is served", lambda: proxy.version_for(None)),
            ("clawbridge_preferences_applied", "Preferences served as an instruction now, every user's together",
             lambda: proxy.standing.enabled * sum(len(x.splitlines()) for x in proxy.standing.texts.values())),
        ):
            Gauge(name, doc, registry=self.registry).set_function(fn)
        if proxy.hooks.metrics_extra is not None:
            self.registry.register(_ExtraGauges(proxy.hooks.metrics_extra))

    def observe(self, status: int, seconds: float) -> None:
        child = self._by_status.get(status)
        if child is None:  # `labels()` costs a lock and a tuple lookup: once per status
            child = self._by_status[status] = self.requests.labels(str(status))
        child.inc()
        self.latency.observe(seconds)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


async def status(proxy: Proxy, caller: Caller = OPERATOR) -> dict[str, Any]:
    """The server's state; for a user's key only what is that user's or no one's: the model, the
    version serving and the user's own open sessions (the counters, the store's counts, the
    learner and the served instruction are everyone's). The operator's shows the version each
    user is served once there are several."""
    backend = proxy.backend
    about = {"model": proxy.model_name, "backend": backend.name, "version": proxy.version_for(caller.user),
             **({"dtype": backend.dtype} if isinstance(backend, NamesItsDtype) else {}),
             "uptime_s": round(time.time() - proxy.started, 1)}
    if caller.user is not None:
        return {**about, "user": caller.user, "sessions_open": proxy.sessions.open_of(caller.user)}
    out: dict[str, Any] = {
        **about,
        "instruction": proxy.standing.served,  # what a request naming nobody is served now (`default`'s)
        **asdict(proxy.counters),  # requests, in_flight, errors, turns recorded / spooled / lost, tokens
        "sessions_open": len(proxy.sessions),
        "turn_counts": dict(proxy.sessions.counts),
        "spool": proxy.durable.status(),
    }
    if proxy.lineages is not None and len(served := proxy.lineages.served()) > 1:  # the version each user is served
        out["users"] = dict(sorted(served.items()))
    try:
        out["store"] = asdict(await proxy.store.run(proxy.store.stats))
    except Exception as e:  # the status page must work while the store is unhappy
        out["store"] = {"error": str(e)}
    if proxy.hooks.status_extra is not None:
        out["extra"] = proxy.hooks.status_extra()
    return out
