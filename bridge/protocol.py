"""The Backend protocol: the verbs every training platform implements, with identical semantics.

Shaped after Tinker's primitives (docs/design.md#the-backend-protocol). A backend carries semantics, it never decides
them: advantages are computed in `clawbridge.learning.advantages`, the loss is `clawbridge.loss`.

Versions: version 0 is the base model. `publish()` makes the trained weights servable as the next
version. A `sample` admitted on version K finishes on version K even if a publish happens
meanwhile; `version=None` means "the version serving at admission".

What serves is routed, not always the newest: `serve(K)` keeps a published version K serving
while a newer candidate is judged by the gate (which samples the candidate by number), and
`serve(None)` goes back to serving the newest. `version` is what a request admitted now is served
by, `newest` the newest published version; they differ only while the gate holds a candidate.
Every backend shares that routing (`Routing`); the platforms differ only in what `newest` is.

Priority: who waits for a sample. `"user"` (the default, and what the HTTP serving path sends):
someone is waiting for the answer. `"background"`: the learner's own sampling (the gate's probes
and twin answers, fresh draws, rewrites, a judge on the backend). A backend that shares its
compute between the two serves the user first (the local engine: docs/engine.md#the-user-first;
SGLang's priority scheduling); one that cannot accepts the keyword and ignores it.

Optional capabilities are protocols of their own (`Restorable`, `Screens`, `HostsJudge`,
`SuggestsMaxTokens`): a caller asks `isinstance(backend, Restorable)`, never `getattr`.

Rollback never rewinds the version counter: `rollback(K)` makes the trainable weights those
published as vK again and publishes them as a NEW version N+1, so a request pinned to any
version still finishes on it, staleness stays a difference of version numbers, and the next
train_step starts from vK's weights. The optimizer state is reset (fresh Adam moments, as after
`load_state` of weights only) on every backend: the moments of the rolled-back-away steps
belong to weights that no longer exist.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

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
    from transformers import PreTrainedTokenizerBase

ScoreModel = Literal["policy", "base"]
Priority = Literal["user", "background"]


class BackendError(Exception):
    """A backend failed in a way the caller should report (not a user error)."""


class ContextLengthExceeded(BackendError):
    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        super().__init__(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            f"completion."
        )


class UnknownVersion(BackendError):
    """A rollback named a version that was never published (or whose weights are gone)."""

    def __init__(self, version: int, newest: int, detail: str = "") -> None:
        self.version = version
        self.newest = newest
        super().__init__(detail or f"policy@v{version} was never published (the newest is v{newest})")


def require_published(version: int, newest: int) -> None:
    """UnknownVersion unless v0 <= `version` <= the newest published version."""
    if not 0 <= version <= newest:
        raise UnknownVersion(version, newest)


class TransientBackendError(BackendError):
    """Worth retrying: rate limits, 5xx, timeouts, a hot-load in progress."""


class Routing:
    """Which published version serves: the newest, unless `serve` holds an older one. Every
    backend inherits this and defines `newest` (what its platform has published)."""

    held: int | None = None  # the version held serving while a newer one is judged; None: the newest

    @property
    def newest(self) -> int:
        raise NotImplementedError

    @property
    def version(self) -> int:
        """The version a request admitted now is served by."""
        return self.newest if self.held is None else self.held

    def serve(self, version: int | None) -> None:
        """Serve the published `version` to requests admitted from now on; None: the newest.
        Requests already admitted finish on the version they were admitted on."""
        if version is not None:
            require_published(version, self.newest)
        self.held = version

    def route(self, version: int | None) -> int:
        """The version a request that asks for `version` runs on (None: the serving one)."""
        return self.version if version is None else version


@runtime_checkable
class Backend(Protocol):
    name: str  # "local", "tinker", "fireworks", "modal"
    model_name: str  # what /v1/models lists
    context_length: int

    @property
    def version(self) -> int:
        """The version a request admitted now is served by (`Routing`)."""
        ...

    @property
    def newest(self) -> int:
        """The newest published version (a candidate under the gate's judgement, perhaps)."""
        ...

    def serve(self, version: int | None) -> None:
        """Serve the published `version` from now on (None: the newest); `Routing`."""
        ...

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The served model's tokenizer (with its chat template); the renderer is built on it."""
        ...

    async def start(self) -> None:
        """Load models / open remote sessions. Called once before any other verb."""
        ...

    async def sample(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        n: int = 1,
        version: int | None = None,
        priority: Priority = "user",
    ) -> list[Completion]:
        """n completions of the prompt, each with per-token behaviour logprobs. `priority`:
        "background" for the learner's own sampling (see the module's docstring)."""
        ...

    def sample_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        version: int | None = None,
        priority: Priority = "user",
    ) -> AsyncIterator[TokenChunk]:
        """One completion as chunks of tokens, as soon as they exist. Platforms that cannot
        stream yield a single chunk."""
        ...

    async def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        model: ScoreModel = "policy",
        temperature: float = 1.0,
        version: int | None = None,
    ) -> list[float]:
        """log p(completion_ids[i] | prompt, completion_ids[:i]) for every completion token
        (suffix only), under a published policy (`version`; None: the newest) or the frozen base."""
        ...

    async def train_step(
        self,
        batch: Sequence[Datum],
        loss: LossSpec = LossSpec(),
        optim: OptimSpec = OptimSpec(),
    ) -> StepMetrics:
        """Forward + backward + one optimizer step with the loss of docs/design.md#the-loss
        (token-mean over the batch's completion tokens)."""
        ...

    async def publish(self) -> PolicyVersion:
        """Make the trained weights servable as version `self.version + 1`."""
        ...

    async def rollback(self, version: int) -> PolicyVersion:
        """Restore the trainable weights to those published as `version` (0: the initial
        adapter, i.e. the base model), reset the optimizer, and publish them as version
        `self.version + 1`. A version that was never published, or whose weights are gone,
        raises BackendError and changes nothing."""
        ...

    async def save_state(self, name: str) -> str:
        """Checkpoint adapter + optimizer state; returns where it lives."""
        ...

    async def load_state(self, name: str) -> None:
        """Resume from `save_state(name)`: the next train_step continues identically."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Restorable(Protocol):
    """Can serve and train on from a published version's weights (with a fresh optimizer), which
    a restart needs when the newest version is newer than the last checkpoint."""

    async def restore(self, version: int, path: str | None) -> None: ...


@runtime_checkable
class Lineages(Protocol):
    """Trains several users' adapters over one base model, one at a time: `switch` makes another
    user's lineage the trainable one (docs/learning.md#each-user-their-own-adapter). Versions
    stay one numbering for all users, and any published version can be served or scored by
    number (`sample`, `score`), so each user is served their own while another's trains."""

    async def switch(self, state: str | None = None, version: int = 0, path: str | None = None) -> None:
        """Train on from the checkpoint `state` (a `save_state` of the lineage switched to: its
        weights and optimizer exactly) or, without one, from published `version`'s weights (at
        `path` where the platform keeps them apart; 0: a fresh adapter, the base model) with a fresh
        optimizer. What is published and what serves, and the next version's number, are
        unchanged (unlike `load_state` and `restore`, which set the newest version)."""
        ...


@runtime_checkable
class ServesAdapters(Protocol):
    """Serves a published version as a registered adapter (`adapter_for`), which `sample` and
    `sample_stream` then name (`adapter=KEY`) instead of a version: rows on many users' versions
    decode in one batch through a per-row gather of the adapters rather than the slower mixed
    batch of versions (the embedded engine; docs/engine.md). A user's lineage other than the
    default user's is served this way (`learning.lineages`)."""

    async def adapter_for(self, version: int, path: str | None = None) -> str: ...

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1,
                     version: int | None = None, priority: Priority = "user",
                     adapter: str | None = None) -> list[Completion]: ...

    def sample_stream(self, prompt_ids: Sequence[int], params: SamplingParams, *, version: int | None = None,
                      priority: Priority = "user", adapter: str | None = None) -> AsyncIterator[TokenChunk]: ...


@runtime_checkable
class Blends(Protocol):
    """Can publish a published version's LoRA delta scaled toward the base: base + alpha * delta,
    exactly (a LoRA delta is B @ A, so B scaled by alpha). The gate tries such a blend of a
    candidate it held back before giving the candidate up (`Settings.gate_blend`). The embedded
    engine blends; Tinker and Fireworks hold the weights out of reach, and Modal and the GPU stack
    do not implement it yet."""

    async def blend(self, version: int, alpha: float) -> PolicyVersion:
        """Publish `version`'s weights with their delta scaled by `alpha` (0 < alpha <= 1) as
        version `self.version + 1`, and train on from them with a fresh optimizer. A version
        never published, or whose weights are gone, raises BackendError and changes nothing."""
        ...


@runtime_checkable
class Screens(Protocol):
    """Knows samples it can never train (a greedy turn on a temperature-1-only platform)."""

    def untrainable(self, datum: Datum) -> str | None:
        """Why `datum` can never be trained here; None when it can."""
        ...


@runtime_checkable
class HostsJudge(Protocol):
    """Runs a judge model of its own beside the policy (the GPU stack's PRM server)."""

    @property
    def judge_endpoint(self) -> tuple[str, str]:
        """(base URL, model name) of the judge's OpenAI-compatible endpoint."""
        ...


@runtime_checkable
class SuggestsMaxTokens(Protocol):
    """Suggests a completion budget to clients that name none (None: the server's default)."""

    suggested_max_tokens: int | None


@runtime_checkable
class DistillsTopK(Protocol):
    """Its `train_step` distils the teacher's top-k next-token distribution (`LossSpec.topk`, a
    `Datum.teacher_prompt_ids`): the loss needs the teacher's full logits at every position, which
    only a backend that runs the base model inside its own loss has. The others refuse
    `opd_topk` at start."""

    distills_topk: bool


@runtime_checkable
class NamesItsDtype(Protocol):
    """Computes in a dtype it names (the embedded engine: "bf16" or "fp32"), which the banner,
    /v1/models and status show."""

    dtype: str
