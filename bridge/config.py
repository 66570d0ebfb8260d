"""The one settings object. Fed by CLI flags, the environment (`CLAWBRIDGE_*`) and an optional
config file (`--config FILE`, YAML or JSON), all by the flat names docs/configuration.md lists.
Nothing else in clawbridge reads `os.environ` except the cloud SDKs' own credential variables,
which `clawbridge doctor` checks. `PORT` is honoured as an alias of `CLAWBRIDGE_PORT`.

The parts of the learner take only their section (`settings.learning`, `.training`, `.judging`,
`.gating`): frozen records of the fields each reads, built from the one loaded object, so a
part's constructor says what it depends on and a test builds it from a few values."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from clawbridge.types import LossSpec, Method, OptimSpec
from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

BackendName = Literal["local", "tinker", "fireworks", "modal"]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def default_cache_dir() -> Path:
    """The cache the embedded model is materialised into (XDG layout). The settings object passes
    its own `cache_dir`; this default is for library use without settings."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "clawbridge"


@dataclass(frozen=True)
class LearningSettings:
    """What turns judged turns and episodes into advantages (the collector, the episodes)."""

    method: Method
    teacher: Literal["base", "policy"]
    w_opd: float
    w_rl: float
    opd_clip: float
    rewrites: int
    rewrite_pick: Literal["lift", "surest"]
    rewrite_min_relevance: float
    rewrite_min_lift: float
    w_rewrite: float
    w_negative: float
    kl_anchor: float
    episode_timeout_s: float
    episode_prm_lambda: float
    overlong_max_tokens: int
    overlong_cache_tokens: int


@dataclass(frozen=True)
class TrainingSettings:
    """What the trainer reads: the batch, staleness, the loss and optimizer, checkpoints."""

    method: Method
    batch_size: int
    max_staleness: int
    learning_rate: float
    warmup_steps: int
    grad_clip_norm: float
    clip_low: float
    clip_high: float
    kl_coef: float
    opd_topk: int
    opd_topk_coef: float
    opd_topk_rewrite: bool
    opd_draws: int
    opd_draw_max_lift: float | None
    teacher: Literal["base", "policy"]
    checkpoint_every: int
    gate_recent: int  # how many of a batch's prompts the gate replays pairwise
    gate_patience: int
    gate_blend: tuple[float, ...]

    @property
    def loss(self) -> LossSpec:
        return LossSpec(clip_low=self.clip_low, clip_high=self.clip_high, kl_coef=self.kl_coef,
                        topk=self.opd_topk, topk_coef=self.opd_topk_coef, topk_teacher=self.teacher)

    @property
    def optim(self) -> OptimSpec:
        return OptimSpec(learning_rate=self.learning_rate, grad_clip_norm=self.grad_clip_norm)


@dataclass(frozen=True)
class JudgeSettings:
    """Which judges, at which endpoint, with how many votes."""

    judge: Literal["auto", "rules", "http", "backend"]
    judge_url: str | None
    judge_model: str | None
    judge_api_key: SecretStr | None
    prm_votes: int
    hint_votes: int
    hint_selection: Literal["longest", "overlap"]
    redact: bool
    seed: int

    @property
    def kind(self) -> str:
        """`auto` is http when a judge endpoint is configured, else the offline rules judge."""
        if self.judge != "auto":
            return self.judge
        return "http" if self.judge_url else "rules"


@dataclass(frozen=True)
class GateSettings:
    """What the gate asks each candidate, and how it decides."""

    gate: Literal["on", "off"]
    gate_probes: int
    gate_probes_max: int
    gate_samples: int
    gate_recent: int
    gate_margin: float
    gate_alpha: float
    gate_alpha_base: float
    gate_v0_test: Literal["non_inferiority", "harm"]
    gate_reference: Literal["twin", "v0"]
    gate_max_price: float
    gate_reference_samples: int
    gate_max_tokens: int
    gate_temperature: float
    seed: int


Section = TypeVar("Section")


def section(cls: type[Section], settings: Settings) -> Section:
    """The section `cls` of `settings`: its fields' values, read by name."""
    return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})  # type: ignore[arg-type]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CLAWBRIDGE_", extra="forbid", validate_default=True, populate_by_name=True
    )

    # --- serving ----------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to bind. Any non-loopback address requires an API key.")
    port: int = Field(
        30000, ge=0, le=65535, validation_alias=AliasChoices("port", "CLAWBRIDGE_PORT", "PORT"),
        description="Port to bind (env PORT also works).",
    )
    api_key: SecretStr | None = Field(None, description="Bearer key every request must carry (required off loopback).")
    backend: BackendName = Field("local", description="Training and serving platform.")
    model: str = Field("smollm2-135m-instruct", description="Registry name (smollm2-135m-instruct, tiny-random), a local HF directory, or the platform's base model name.")
    served_model_name: str | None = Field(None, description="Name listed by /v1/models (default: the model's name).")
    data_dir: Path = Field(Path(".clawbridge"), description="Store, adapters, checkpoints, logs.")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Where the embedded model is materialised.")
    db: str | None = Field(None, description="SQLAlchemy URL; default SQLite (WAL) in the data directory.")
    max_request_bytes: int = Field(8 * 1024 * 1024, description="Larger request bodies get HTTP 413.")
    body_timeout_s: float = Field(30.0, gt=0, description="A request body not fully received in this time gets HTTP 408.")
    keep_alive_s: float = Field(
        75.0, gt=0,
        description="Idle keep-alive connections are closed after this long; above common client pools' idle "
        "expiry (httpx and the openai SDK 5 s, aiohttp 15 s, Node 4-5 s), so a pooled connection is never "
        "closed under a client's next request.",
    )
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request sets none.")
    default_turn_type: Literal["main", "side"] = Field("main", description="Turn type of untagged requests.")
    session_idle_timeout_s: float = Field(1800.0, gt=0, description="A session with no request for this long is closed.")
    shutdown_grace_s: float = Field(
        3.0, ge=1,
        description="On SIGTERM or Ctrl-C, streams in flight may finish for this long before they are ended; the "
        "learner's work in flight is abandoned at once (redone after a restart), so the process exits within a "
        "few seconds of it (container runtimes send SIGKILL after 10 s).",
    )

    # --- learning ---------------------------------------------------------------------------------
    train: bool = Field(True, description="Judge and train in the background (false: serve and capture only).")
    method: Method = Field("combine", description="How judged turns become advantages.")
    seed: int = Field(0, description="Seed for LoRA initialisation and the demo.")
    redact: bool = Field(False, description="Redact emails, phone numbers and key-like strings in everything sent off the machine (cloud sampling, scoring and training prompts, and the judge endpoint). Off by default: it changes what the model sees.")
    budget_usd: float | None = Field(None, ge=0, description="Stop training (never serving) when spend reaches this.")
    resume: bool = Field(False, description="Kept for compatibility: every start continues from the newest published version (and its checkpoint when it has one).")

    # --- judges (settings.judging) ----------------------------------------------------------------
    judge: Literal["auto", "rules", "http", "backend"] = Field("auto", description="auto: http if --judge-url is set, else the offline rules judge.")
    judge_url: str | None = Field(None, description="OpenAI-compatible endpoint of the judge model.")
    judge_model: str | None = Field(None, description="Judge model name at that endpoint.")
    judge_api_key: SecretStr | None = Field(None, description="Key for the judge endpoint.")
    prm_votes: int = Field(3, ge=1, description="PRM votes per turn (majority; tie -> 0).")
    hint_votes: int = Field(3, ge=1, description="Hint-judge votes per turn (OPD).")
    hint_selection: Literal["longest", "overlap"] = Field("longest", description="How one hint is chosen among accepted ones.")

    # --- advantages (settings.learning) -----------------------------------------------------------
    teacher: Literal["base", "policy"] = Field("base", description="OPD teacher: the frozen base or the live policy, with the hint: its token logprobs, the rewrites it writes and the top-k distribution (opd_topk) all come from it.")
    w_opd: float = Field(1.0, description="Weight of the OPD term in combine.")
    w_rl: float = Field(1.0, description="Weight of the reward term in combine.")
    opd_clip: float = Field(1.0, gt=0, description="Clip of teacher - student logprob gaps.")
    rewrites: int = Field(0, ge=0, le=16, description="Hint-guided rewrites: the teacher (the model with the hint) writes this many answers to a hinted turn's prompt, and one of them (rewrite_pick) is trained as a demonstration beside the turn (docs/methods.md); 0 turns it off.")
    rewrite_pick: Literal["lift", "surest"] = Field("lift", description="Which teacher draw a rewrite trains (a draw that ends by itself before one cut at max_tokens): lift, the one the hint made likeliest relative to the same model without it (mean logprob per token with − without the hint); surest, the teacher's most confident (docs/methods.md).")
    rewrite_min_relevance: float = Field(15.0, description="A rewrite draw must be explained by the question: its teacher log-likelihood with the question at least this many nats above the same with the question blanked, summed over the draw; echoes of the hint and remarks about the answer fall below it (docs/methods.md). -1e9 turns the floor off.")
    rewrite_min_lift: float = Field(0.3, description="A rewrite draw must be what the hint asked for: the hint must make it at least this many nats per token likelier than the same model without the hint (its lift, mean over the draw); a draw the hint barely moved is the model's own habit, and trained as a demonstration it pulls a student that has passed its teacher back to the teacher (docs/methods.md). -1e9 turns the floor off.")
    w_rewrite: float = Field(1.0, ge=0, description="Advantage of every token of a hint-guided rewrite.")
    w_negative: float = Field(1.0, ge=0, description="Scale of the negative advantages on a turn's own answer (0: learn only from approved answers, the teacher's gains and rewrites, never push a sampled token down; docs/methods.md).")
    kl_anchor: float = Field(0.0, ge=0, description="Anchor to the base model carried in the advantages: A_t -= kl_anchor * (log pi_old - log pi_base) on every token feedback trains (the answer and its rewrite), identical on every backend; 0 (the measured default) turns it off (docs/methods.md).")
    episode_timeout_s: float = Field(3600.0, gt=0, description="An episode with no outcome this long after its group opened expires (stored with the reason) and trains nothing.")
    episode_prm_lambda: float = Field(0.0, ge=0, description="Integrate per-step PRM votes into episode rewards: r = outcome + lambda/m * sum(votes); 0: the outcome alone (no judge calls).")
    overlong_max_tokens: int = Field(0, ge=0, description="Episode turns longer than this get reward -1 added, ramping in over overlong_cache_tokens before it (DAPO); 0 turns it off.")
    overlong_cache_tokens: int = Field(0, ge=0, description="Length of the overlong penalty's ramp (tokens before overlong_max_tokens).")

    # --- training (settings.training) -------------------------------------------------------------
    batch_size: int = Field(16, ge=1, description="Samples per training step.")
    max_staleness: int = Field(4, ge=0, description="Samples older than this many versions are dropped.")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate of the LoRA parameters.")
    warmup_steps: int = Field(0, ge=0, description="After every fresh optimizer (a new run, a gate's hold-back, a rollback, a resume from published weights) the learning rate ramps up linearly over this many steps: step k trains at learning_rate * min(1, k / warmup_steps). Adam's first step moves every parameter by the full rate whatever its gradient (docs/methods.md#a-warmup-after-every-fresh-optimizer-warmup_steps); 0 turns it off.")
    grad_clip_norm: float = Field(1.0, ge=0, description="Gradient norm clip; 0 disables it.")
    clip_low: float = Field(0.2, ge=0, description="PPO clip below: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO clip above: ratio <= 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the base model (adapter disabled); 0 turns it off.")
    opd_topk: int = Field(0, ge=0, le=1000, description="Top-k distillation: every hinted sample's tokens (its answer and its rewrite) also learn the teacher's whole next-token distribution, as KL(policy || teacher) over the teacher's top opd_topk tokens plus one bin for the rest, at every position (docs/methods.md#top-k-distillation-opd_topk). Needs a backend that runs the base model inside its loss (local); 0 turns it off.")
    opd_topk_coef: float = Field(1.0, ge=0, description="Weight of the top-k distillation term in the loss.")
    opd_topk_rewrite: bool = Field(True, description="A hint-guided rewrite also learns the teacher's top-k distribution along its tokens (opd_topk). A rewrite is a draw the hint favours (rewrite_min_lift): distilling the teacher along it pulls a student that has passed its teacher back to the teacher's own rate, as for fresh draws (opd_draw_max_lift), but its distillation toward the base is also part of what brings a lineage out of the valley: measured off, the third candidate stayed held back on the probe in three runs of three (docs/methods.md#top-k-distillation-opd_topk). False: the rewrite trains by its advantage alone.")
    opd_draws: int = Field(0, ge=0, le=16, description="On-policy distillation on fresh draws: at every step the policy being trained answers each hinted sample's prompt this many times more, and those answers learn the teacher's top-k distribution alone (no reward of their own; they are not stored). Needs opd_topk (docs/methods.md#top-k-distillation-opd_topk); 0 turns it off.")
    opd_draw_max_lift: float | None = Field(None, description="A fresh draw (opd_draws) learns the teacher's top-k distribution only when the hint makes it no likelier than this: its lift, the mean per token of the teacher's model's logprob with the hint minus without it (the measure a rewrite is picked by). A draw the hint favours already carries the preference, and distilling the teacher along it pulls a student that has passed its teacher back to the teacher's own rate (docs/methods.md#fresh-draws-the-hint-is-against-opd_draw_max_lift). None: every draw distils.")
    checkpoint_every: int = Field(10, ge=1, description="Save resumable state every N steps.")
    lora_rank: int = Field(32, ge=1, description="LoRA rank (all linear layers).")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (scale alpha/rank).")
    prefix_cache_mb: int = Field(2048, ge=0, description="Torch engine: memory for the KV of recent prompts, reused when a new prompt shares their prefix (0: off).")
    engine_max_batch: int = Field(16, ge=1, le=256, description="Torch engine: requests decoded together; more wait their turn. More rows raise throughput and each stream's time per token (on 2 CPU cores, 40-token answers: 122 tok/s at 16, 143 at 32, each stream 1.7x slower), docs/engine.md.")
    engine_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="Torch engine on a CPU: the arithmetic of the base model's matmuls. auto (default): bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), fp32 elsewhere. bf16 is bf16 matmuls in an fp32 model (the linear weights bf16; the residual stream, attention, KV cache, head, logprobs and the LoRA adapters fp32): faster where the matmuls are the work, and scores agree with the sampled logprobs to about 0.014 (fp32: bit for bit, 4e-6), docs/engine.md. fp32: exact logprobs.")
    engine_merge_adapters: bool = Field(True, description="Torch engine on a CPU in bf16: a forward whose rows all run on one served version uses that adapter merged into the bf16 weights (W + scale·B·A rounded stochastically, packed once per version, two kept: ~210 MB each for the embedded model) instead of the base weights plus LoRA products: 1.46x the decode rate on an adapter (2 cores), and the trainer's forward 0.018 nats a token from the sampled logprobs instead of 0.013, docs/engine.md. false: always the base weights plus the adapter.")

    # --- gate (settings.gating) -------------------------------------------------------------------
    gate: Literal["on", "off"] = Field("on", description="Compare every trained candidate with the serving version on probes before it serves (off: publish at once).")
    gate_probes: int = Field(24, ge=0, le=200, description="Questions of the general probe set the gate asks each version (0: only the caller's probes).")
    gate_probes_max: int = Field(50, ge=0, le=200, description="General probe questions asked in all unless the first gate_probes already hold the candidate back beyond doubt (an early look's stricter significance): a candidate is accepted only on all of them. Equal to gate_probes (or less): never ask more, the first probes decide both ways.")
    gate_samples: int = Field(1, ge=1, description="Answers per probe and version.")
    gate_recent: int = Field(8, ge=0, description="The user's recent prompts the gate replays on both versions for the judge model to compare pairwise (not with the rules judge).")
    gate_margin: float = Field(0.05, ge=0, le=1, description="A candidate worse than this (a rate difference) with p < gate_alpha is held back.")
    gate_alpha: float = Field(0.1, gt=0, lt=1, description="Significance of the gate's one-sided paired test.")
    gate_alpha_base: float = Field(0.2, gt=0, lt=1, description="Significance of the comparisons with v0, the base: they guard what all the steps together cost, so the test is stricter (a loss beyond gate_margin at p < 0.2 holds the candidate back).")
    gate_v0_test: Literal["non_inferiority", "harm"] = Field("non_inferiority", description="What the comparison with v0 asks: non_inferiority (a candidate serves only when shown to lose less than gate_margin, p < gate_alpha_base) or harm (it is held back only when shown to lose more: more candidates serve, and among many candidates the one whose answers happened to look fine).")
    gate_reference: Literal["twin", "v0"] = Field("twin", description="What the general probe is judged against. twin: the base model asked for the user's standing preferences (`clawbridge preferences`; the instruction the OPD teacher gets): paying their price is not harm, falling more than gate_margin below the twin is, and the candidate's mean on every probe asked decides. v0: strict, no worse than the base model (gate_v0_test decides), for users who would rather keep facts than preferences.")
    gate_patience: int = Field(0, ge=0, le=100, description="Held-back candidates in a row that training continues from (the served version keeps serving meanwhile) before it restarts from the served weights with a fresh optimizer; 0: every hold-back restarts from the served weights (docs/methods.md#patience-training-on-through-a-held-back-candidate-gate_patience).")
    gate_blend: tuple[float, ...] = Field((), description="Before a held-back candidate is given up (training restarts from the served weights), the gate judges it with its LoRA delta scaled by each of these in turn (base + alpha x delta, 0 < alpha < 1: back toward the base); the first accepted serves and training goes on from it with a fresh optimizer. Empty: off. Needs a backend that blends (local) (docs/methods.md#a-blend-before-giving-up-gate_blend).")
    gate_max_price: float = Field(0.15, ge=0, le=1, description="The most general-probe answers (a rate) the preferences may cost, and the most a served version may fall below v0: above it, candidates are held back with the price as the reason. Raising it is consenting to a higher price.")
    gate_reference_samples: int = Field(2, ge=1, description="Answers per probe of v0 and the twin, asked once for every candidate (so more are cheap): the more, the fewer wrong decisions (docs/methods.md#harm-is-judged-against-what-you-asked-for).")
    gate_max_tokens: int = Field(64, ge=1, description="max_tokens of a probe answer.")
    gate_temperature: float = Field(0.7, gt=0, description="Temperature of probe answers.")

    # --- cloud backends (docs/backends.md) --------------------------------------------------------
    tinker_base_model: str = Field("Qwen/Qwen3-4B-Instruct-2507", description="Tinker base model (one from Tinker's list).")
    tinker_persist_every: int = Field(10, ge=0, description="Also save persistent sampler weights every N publishes (0: never).")
    fireworks_mode: Literal["serverless", "dedicated"] = Field("serverless", description="Fireworks training API mode.")
    fireworks_base_model: str = Field("accounts/fireworks/models/qwen3-4b", description="Fireworks base model resource.")
    fireworks_base_url: str = Field("https://api.fireworks.ai/training/v1/serverless", description="Fireworks training endpoint (dedicated: the trainer job's URL).")
    fireworks_deployment_id: str | None = Field(None, description="Dedicated mode: the inference deployment that serves and hot-loads the policy.")
    modal_app: str = Field("clawbridge", description="Deployed Modal app name (`clawbridge modal deploy`).")
    modal_gpu: str = Field("H100", description="GPU of the Modal engine class.")
    cloud_timeout_s: float = Field(600.0, gt=0, description="Timeout of every remote call.")
    cloud_attempts: int = Field(5, ge=1, description="Attempts per remote call on transient errors (backoff between).")
    cloud_context_length: int = Field(32768, ge=1, description="Context length of the cloud base model.")

    # --- local GPU layout -------------------------------------------------------------------------
    num_gpus: int | None = Field(None, ge=0, description="GPUs to use (default: all visible).")
    actor_gpus: int | None = Field(None, ge=0, description="GPUs for the FSDP2 trainer (default: half).")
    rollout_gpus: int | None = Field(None, ge=0, description="GPUs for the policy SGLang server(s).")
    prm_gpus: int | None = Field(None, ge=0, description="GPUs for the judge SGLang server.")

    # --- spool: the writes the store cannot take (docs/store.md#when-the-store-is-down) -----------
    # Read in one place: `serving.durable.SpoolSettings.of`.
    spool_dir: Path | None = Field(None, description="Where writes the store cannot take (down, full disk, locked) wait, fsynced, until it is back (default: spool/ in the data directory). For a SQLite store on a disk that may fill, a path on another filesystem.")
    spool_max_mb: int = Field(256, ge=1, description="The spool's size limit; past it new turns are not recorded (counted as lost) or, with spool_full 503, requests are refused.")
    spool_full: Literal["drop", "503"] = Field("drop", description="When the spool is full: drop (answer, and count the turns that cannot be recorded as lost: availability) or 503 (refuse new requests until it has room: durability).")
    store_write_timeout_s: float = Field(5.0, gt=0, description="A write the store has not committed in this time goes to the spool, so a hung connection stalls no request.")
    # --- end of spool ---------------------------------------------------------------------------

    @field_validator("api_key", "judge_api_key", mode="after")
    @classmethod
    def _empty_key_is_none(cls, v: SecretStr | None) -> SecretStr | None:
        # `CLAWBRIDGE_API_KEY=` (a compose file leaving it blank) is no key, never a key "".
        return v if v is not None and v.get_secret_value().strip() else None

    @field_validator("gate_blend", mode="after")
    @classmethod
    def _blend_toward_the_base(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 < a < 1.0 for a in v):
            raise ValueError(f"gate_blend's alphas scale a candidate's delta back toward the base: each in (0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _key_off_loopback(self) -> Settings:
        if self.host not in LOOPBACK and self.api_key is None:
            raise ValueError(
                f"binding {self.host} exposes the model beyond this machine: set --api-key "
                "(or CLAWBRIDGE_API_KEY, not empty) so every request must carry it"
            )
        return self

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite:///{(self.data_dir / 'clawbridge.db').resolve()}"

    @property
    def learning(self) -> LearningSettings:
        return section(LearningSettings, self)

    @property
    def training(self) -> TrainingSettings:
        return section(TrainingSettings, self)

    @property
    def judging(self) -> JudgeSettings:
        return section(JudgeSettings, self)

    @property
    def gating(self) -> GateSettings:
        return section(GateSettings, self)

    @property
    def loss(self) -> LossSpec:
        return self.training.loss

    @property
    def optim(self) -> OptimSpec:
        return self.training.optim

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Flags (`overrides`; None means not given) > environment > config file > defaults."""
        file_values: dict[str, Any] = {}
        if config_file is not None:
            text = config_file.read_text()
            if config_file.suffix in {".yaml", ".yml"}:
                import yaml

                file_values = yaml.safe_load(text) or {}
            else:
                file_values = json.loads(text)
        from_env = _env_values(cls)
        flags = {k: v for k, v in overrides.items() if v is not None}
        return cls(**{**file_values, **from_env, **flags})


def _env_values(cls: type[Settings]) -> dict[str, Any]:
    """The fields the environment sets (so they can outrank the config file)."""
    import os

    out: dict[str, Any] = {}
    for name in cls.model_fields:
        for var in (f"CLAWBRIDGE_{name.upper()}", *(("PORT",) if name == "port" else ())):
            if var in os.environ:
                out[name] = os.environ[var]
                break
    return out
