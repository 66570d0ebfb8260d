"""Each user their own adapter (docs/learning.md#each-user-their-own-adapter): a lineage per user
over one backend and one store.

A lineage is what one adapter needs to learn and to serve: its versions, the version that
serves it, its samples, its gate decisions, its preferences, its optimizer. The learning code
(the trainer, the promotion, the gate) is written for one lineage; here each user gets a view
of the backend (`LineageBackend`) and of the store (`UserStore`) that *is* one lineage, so that
code runs unchanged, once per user:

    the backend view: `newest` is the user's newest version, `serve`/`version` the user's own
    routing, `score(model="policy")` the user's newest weights, and every verb that touches the
    trainable weights (train_step, publish, rollback, blend, save_state) first makes the user's
    lineage the trainable one (`Switchboard.hold`);
    the store view: the user's samples, versions, steps, decisions and preferences only, and
    every record it writes stamped with the user.

One backend trains one lineage at a time: `Switchboard.hold` saves the lineage it leaves as a
checkpoint of that lineage (weights and optimizer exactly) and `switch`es to the one it enters
(its checkpoint, else its newest published weights with a fresh optimizer, else a fresh
adapter). Version numbers stay one numbering for every user, so a version number names one
adapter wherever it appears; any version is served and scored by number, so every user is
served their own version while another user's trains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clawbridge.learning.promotion import CHECKPOINT_KEY, Resumed
from clawbridge.protocol import (
    BackendError,
    Blends,
    Lineages,
    Priority,
    Routing,
    ScoreModel,
    Screens,
    ServesAdapters,
    UnknownVersion,
)
from clawbridge.store.records import DEFAULT_USER
from clawbridge.types import (
    Completion,
    Datum,
    LossSpec,
    OptimSpec,
    PolicyVersion,
    SamplingParams,
    StepMetrics,
    TokenChunk,
)

if TYPE_CHECKING:
    from clawbridge.learning.trainer import Trainer
    from clawbridge.protocol import Backend
    from clawbridge.store import Store
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

LINEAGE_KEY = "lineage.state"  # store meta, per user (`UserStore.meta_key`): the state saved when switched out


def meta_key(key: str, user: str) -> str:
    """A store meta key of `user`'s lineage (pure): the default user's is the key itself, so a
    single-user install reads and writes what it always did."""
    return key if user == DEFAULT_USER else f"{key}@{user}"


def state_name(user: str) -> str:
    """The checkpoint name of `user`'s lineage while another trains (pure; a file name)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", user)[:64]
    return f"lineage-{user}" if safe == user else f"lineage-{safe}-{hashlib.sha256(user.encode()).hexdigest()[:12]}"


class UserStore:
    """The store as one user's lineage sees it: the learning code's reads are the user's, its
    records the user's. Everything else is the store's own (`__getattr__`). Not `scoped`: the
    one lineage of a backend that keeps one adapter, which reads every user's samples."""

    def __init__(self, store: Store, user: str, *, scoped: bool = True) -> None:
        self.base, self.user = store, user
        self.only = user if scoped else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self.base.run(fn, *args, **kwargs)

    def pending_samples(self, limit: int | None = None, **kw: Any) -> Any:
        return self.base.pending_samples(limit, user=self.only, **kw)

    def drop_stale_samples(self, oldest_fresh: int) -> int:
        return self.base.drop_stale_samples(oldest_fresh, self.only)

    def latest_version(self) -> Any:
        return self.base.latest_version(self.user)

    def versions(self) -> Any:
        return self.base.versions(self.user)

    def history(self) -> Any:
        return self.base.history(self.user)

    def training_steps(self) -> Any:
        return self.base.training_steps(self.user)

    def all_preferences(self, states: Sequence[str] | None = None) -> tuple[Any, ...]:
        return tuple(p for p in self.base.all_preferences(states) if self.only in (None, p.user))

    def get_meta(self, key: str, default: Any = None) -> Any:
        return self.base.get_meta(meta_key(key, self.user), default)

    def set_meta(self, key: str, value: Any) -> None:
        self.base.set_meta(meta_key(key, self.user), value)

    def record_policy_version(self, row: Any) -> None:
        self.base.record_policy_version(dataclasses.replace(row, user=self.user))

    def record_gate_decision(self, record: Any) -> None:
        self.base.record_gate_decision(dataclasses.replace(record, user=self.user))

    async def commit_step(self, step: Any, sample_ids: Sequence[int], policy: Any = None) -> None:
        await self.base.commit_step(dataclasses.replace(step, user=self.user), sample_ids,
                                    None if policy is None else dataclasses.replace(policy, user=self.user))


class Switchboard:
    """Which user's lineage the backend's trainable weights are now, and the switch between two.
    Every verb that changes the trainable weights runs under the learner's one lock, so no two
    lineages interleave."""

    def __init__(self, backend: Backend, store: Store) -> None:
        self.backend, self.store = backend, store
        self.current: str = DEFAULT_USER  # `resume` at the start loads the default user's lineage
        self.views: dict[str, LineageBackend] = {}
        self.switches = 0

    @property
    def per_user(self) -> bool:
        """Whether users other than the default can have adapters of their own."""
        return isinstance(self.backend, Lineages)

    async def hold(self, user: str) -> None:
        """Make `user`'s lineage the trainable one: the one left is saved (`LINEAGE_KEY`), the
        one entered comes back from its saved state when that is of its newest version, else from
        its newest published weights with a fresh optimizer (v0: a fresh adapter)."""
        if user == self.current:
            return
        if not isinstance(self.backend, Lineages):
            raise BackendError(f"the {self.backend.name} backend keeps one adapter: user {user!r} cannot train one of their own")
        left = self.views.get(self.current)
        path = await self.backend.save_state(state_name(self.current))
        await self.store.run(UserStore(self.store, self.current).set_meta, LINEAGE_KEY,
                             {"path": path, "version": left.newest if left else None})
        entered = self.views[user]
        # its state saved when it was left, or its checkpoint: either, if of its newest version
        kept = [await self.store.run(UserStore(self.store, user).get_meta, key) for key in (LINEAGE_KEY, CHECKPOINT_KEY)]
        state = next((k["path"] for k in kept if k and k.get("version") == entered.newest), None)
        if state is not None:
            await self.backend.switch(state)
        else:
            row = await self.store.run(self.store.latest_version, user)
            await self.backend.switch(None, row.version if row else 0, row.path if row else None)
        log.info("training %s's adapter (was %s's)", user, self.current)
        self.current = user
        self.switches += 1


class LineageBackend(Routing):
    """The backend as one user's lineage sees it (the module's docstring)."""

    def __init__(self, board: Switchboard, user: str, newest: int) -> None:
        self.board, self.user, self._newest = board, user, newest
        self._paths: dict[int, str] = {}  # where this process published a version's weights
        shared = board.backend
        self.shared = shared
        self.name, self.model_name, self.context_length = shared.name, shared.model_name, shared.context_length
        self.distills_topk = bool(getattr(shared, "distills_topk", False))
        board.views[user] = self

    @property
    def newest(self) -> int:
        return self._newest

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.shared.tokenizer()

    async def start(self) -> None:  # the shared backend is started once, by the server
        return None

    async def close(self) -> None:
        return None

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1,
                     version: int | None = None, priority: Priority = "user") -> list[Completion]:
        routed = self.route(version)
        if (key := await self._adapter(routed)) is not None:
            assert isinstance(self.shared, ServesAdapters)
            return await self.shared.sample(prompt_ids, params, n=n, priority=priority, adapter=key)
        return await self.shared.sample(prompt_ids, params, n=n, version=routed, priority=priority)

    async def sample_stream(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                            version: int | None = None, priority: Priority = "user") -> AsyncIterator[TokenChunk]:
        routed = self.route(version)
        if (key := await self._adapter(routed)) is not None:
            assert isinstance(self.shared, ServesAdapters)
            stream = self.shared.sample_stream(prompt_ids, params, priority=priority, adapter=key)
        else:
            stream = self.shared.sample_stream(prompt_ids, params, version=routed, priority=priority)
        async for chunk in stream:
            yield chunk

    async def _adapter(self, version: int) -> str | None:
        """The registered adapter `version` is served as (`protocol.ServesAdapters`): every user's
        but the default user's, whose versions the engine serves (and merges) as always, so rows of
        many users decode in one batch through the per-row gather; None: served as a version."""
        if version == 0 or self.user == DEFAULT_USER or not isinstance(self.shared, ServesAdapters):
            return None
        return await self.shared.adapter_for(version, self._paths.get(version))

    async def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *, model: ScoreModel = "policy",
                    temperature: float = 1.0, version: int | None = None) -> list[float]:
        return await self.shared.score(prompt_ids, completion_ids, model=model, temperature=temperature,
                                       version=self._newest if version is None else version)

    async def train_step(self, batch: Sequence[Datum], loss: LossSpec = LossSpec(),
                         optim: OptimSpec = OptimSpec()) -> StepMetrics:
        await self.board.hold(self.user)
        return await self.shared.train_step(batch, loss, optim)

    async def publish(self) -> PolicyVersion:
        await self.board.hold(self.user)
        return self._published(await self.shared.publish())

    async def rollback(self, version: int) -> PolicyVersion:
        await self._check_own(version)
        await self.board.hold(self.user)
        return self._published(await self.shared.rollback(version))

    async def save_state(self, name: str) -> str:
        await self.board.hold(self.user)
        return await self.shared.save_state(name)

    async def load_state(self, name: str) -> None:
        """`resume`'s checkpoint of this lineage: its weights and optimizer become the trainable ones."""
        if isinstance(self.shared, Lineages):
            await self.shared.switch(name)
        else:
            await self.shared.load_state(name)
        self.board.current = self.user

    async def restore(self, version: int, path: str | None) -> None:
        """`resume` from this lineage's newest published weights (a fresh optimizer)."""
        if isinstance(self.shared, Lineages):
            await self.shared.switch(None, version, path)
        else:
            await self.shared.restore(version, path)  # type: ignore[attr-defined]
        self.board.current = self.user
        self._newest = max(self._newest, version)

    def follow(self, version: int) -> None:
        """Serve `version`, which the trainer in another process published for this user
        (`learning.lease`): this process trains nothing, it follows."""
        self._newest, self.held = version, None

    def _published(self, policy: PolicyVersion) -> PolicyVersion:
        self._newest = policy.version
        if policy.path:
            self._paths[policy.version] = policy.path
        return policy

    async def _check_own(self, version: int) -> None:
        """Another user's version is never this lineage's to serve or train from."""
        if version == 0:
            return
        row = await self.board.store.run(self.board.store.policy_version, version)
        if row is not None and row.user != self.user:
            raise UnknownVersion(version, self._newest, f"policy@v{version} is not one of {self.user}'s versions")


class BlendingLineage(LineageBackend):
    """A lineage on a backend that blends (`protocol.Blends`)."""

    async def blend(self, version: int, alpha: float) -> PolicyVersion:
        await self._check_own(version)
        await self.board.hold(self.user)
        assert isinstance(self.shared, Blends)
        return self._published(await self.shared.blend(version, alpha))


class ScreeningLineage(LineageBackend):
    """A lineage on a backend that knows samples it can never train (`protocol.Screens`)."""

    def untrainable(self, datum: Datum) -> str | None:
        assert isinstance(self.shared, Screens)
        return self.shared.untrainable(datum)


class BlendingScreeningLineage(BlendingLineage, ScreeningLineage):
    pass


def lineage_backend(board: Switchboard, user: str, newest: int) -> LineageBackend:
    """`user`'s view of the board's backend, with the capabilities the backend has."""
    shared = board.backend
    cls = {(False, False): LineageBackend, (True, False): BlendingLineage, (False, True): ScreeningLineage,
           (True, True): BlendingScreeningLineage}[(isinstance(shared, Blends), isinstance(shared, Screens))]
    return cls(board, user, newest)


@dataclass
class Lineage:
    """One user's lineage: the views the learning code runs on, and its trainer once it trains."""

    user: str
    backend: LineageBackend
    store: UserStore
    trainer: Trainer | None = None
    stepped: int = 0  # when it last trained (`UserLineages.turn`): the fair order's clock


class UserLineages:
    """Every user's lineage over one backend and one store. A backend that keeps one adapter
    (not `protocol.Lineages`) has one lineage, the default user's, trained on every user's
    samples and serving everyone, as a single-user install does."""

    def __init__(self, backend: Backend, store: Store) -> None:
        self.board = Switchboard(backend, store)
        self.store = store
        self.by_user: dict[str, Lineage] = {}
        self.make_trainer: Callable[[Lineage], Trainer] | None = None  # the composition root's
        self._clock = 0

    @property
    def per_user(self) -> bool:
        return self.board.per_user

    def name_of(self, user: str | None) -> str:
        """The lineage a user's requests and samples belong to."""
        return (user or DEFAULT_USER) if self.per_user else DEFAULT_USER

    async def load(self) -> None:
        """At the start (and when this process takes training over from another): every user who
        has versions gets their lineage back, at their newest."""
        users = await self.store.run(self.store.lineage_users) if self.per_user else []
        for user in {DEFAULT_USER, *users}:
            row = await self.store.run(self.store.latest_version, user if self.per_user else None)
            self.get(user, row.version if row else 0).backend.follow(row.version if row else 0)

    def get(self, user: str | None, newest: int = 0) -> Lineage:
        """`user`'s lineage, made at `newest` on first need (every user with versions was loaded
        at the start, so a user first seen now has none but v0)."""
        name = self.name_of(user)
        if (found := self.by_user.get(name)) is None:
            found = self.by_user[name] = Lineage(name, lineage_backend(self.board, name, newest),
                                                 UserStore(self.store, name, scoped=self.per_user))
        return found

    @property
    def default(self) -> Lineage:
        return self.get(DEFAULT_USER)

    def serving(self, user: str | None) -> int:
        """The version a request of `user`'s is served by, pinned at admission."""
        return self.get(user).backend.version

    def served(self) -> dict[str, int]:
        """The version each user with a lineage is served now."""
        return {user: lineage.backend.version for user, lineage in self.by_user.items()}

    def trainer(self, lineage: Lineage) -> Trainer:
        if lineage.trainer is None:
            if self.make_trainer is None:
                raise RuntimeError("UserLineages.trainer before the composition root set make_trainer")
            lineage.trainer = self.make_trainer(lineage)
        return lineage.trainer

    async def waiting(self, method: str | None) -> list[Lineage]:
        """The lineages with judged samples, in the fair order: the one that trained longest ago
        first (a user never trained before any that has), so no user's backlog starves another's."""
        if not self.per_user:
            return [self.default]
        users = await self.store.run(self.store.users_with_samples, method)
        return sorted((self.get(u) for u in users), key=lambda lineage: (lineage.stepped, lineage.user))

    def turn(self, lineage: Lineage) -> None:
        """`lineage` just trained a step: it goes to the back of the fair order."""
        self._clock += 1
        lineage.stepped = self._clock


async def settle_start(lineages: UserLineages, resumed: Resumed | None) -> None:
    """At the start, after `promotion.resume` loaded the newest version the store recorded (the
    default user's checkpoint, or the newest published weights of whichever user published
    last): every user's lineage comes back at its newest, and the board knows whose weights
    are the trainable ones now."""
    await lineages.load()
    if resumed is not None and not resumed.optimizer:  # the newest published weights: their owner's
        newest = await lineages.store.run(lineages.store.latest_version)
        if newest is not None and newest.version:
            lineages.board.current = lineages.name_of(newest.user)


__all__ = ["LINEAGE_KEY", "Lineage", "LineageBackend", "Switchboard", "UserLineages", "UserStore", "lineage_backend",
           "meta_key", "settle_start", "state_name"]
