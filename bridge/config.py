"""The one settings object: every setting declared once, in the section of `Settings` that reads
it (`settings.serving`, `.judging`, `.learning`, `.training`, `.gating`, `.engine`, `.cloud`,
`.gpus`; what the whole run shares sits on `Settings` itself).

Users name a setting by its flat name: the flag of `clawbridge up`, `CLAWBRIDGE_<NAME>` in the
environment, a key of the config file (`--config FILE`, YAML or JSON; a section's nested keys work
too). `FLAT` maps each flat name to where it lives. Nothing else in clawbridge reads `os.environ`
except the cloud SDKs' own credential variables, which `clawbridge doctor` checks. `PORT` is
honoured as an alias of `CLAWBRIDGE_PORT`.

The parts of the learner take only their section: a part's constructor says what it depends on,
and a part that needs a field of another section is handed it at the composition root."""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from clawbridge.recipes import LearningRecipe, recipe_for, trained_model
from clawbridge.types import LossSpec, Method, OptimSpec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

BackendName = Literal["local", "tinker", "fireworks", "modal"]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ENV_PREFIX = "CLAWBRIDGE_"


def default_cache_dir() -> Path:
    """The cache the embedded model is materialised into (XDG layout). The settings object passes
    its own `cache_dir`; this default is for library use without settings."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "clawbridge"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ServingSettings(_Section):
    """The HTTP server: where it listens, who may call it, its limits."""

    host: str = Field("127.0.0.1", description="Address to bind; any non-loopback address requires an API key.")
    port: int = Field(30000, ge=0, le=65535, description="Port to bind (the environment's PORT also sets it).")
    api_key: SecretStr | None = Field(None, description="Bearer key every request must carry (required off loopback, unless api_keys_file gives keys); an admin key: every route, any user.")
    api_keys_file: Path | None = Field(None, description="A YAML or JSON file of API keys, each fixed to one user (`keys: {KEY: alice}`) or an admin key (`KEY: {admin: true}`); with it every request needs a key from it or api_key, and a user's key reaches only that user's data (docs/serving.md#users).")
    trust_body_user: bool = Field(False, description="Take the OpenAI body's `user` field as the user a request is for when X-Session-User names none; off because many clients fill it for abuse tracking, not to say whose conversation it is.")
    served_model_name: str | None = Field(None, description="Name listed by /v1/models (default: the model's name).")
    max_request_bytes: int = Field(8 * 1024 * 1024, description="Larger request bodies get HTTP 413.")
    body_timeout_s: float = Field(30.0, gt=0, description="A request body not fully received in this time gets HTTP 408.")
    keep_alive_s: float = Field(
        75.0, gt=0,
        description="Idle keep-alive connections are closed after this long: longer than common client pools "
        "keep an idle connection, so a pooled connection is never closed under a client's next request.",
    )
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request sets none.")
    default_temperature: float = Field(1.0, ge=0, le=2, description="Temperature when a request sets none (OpenAI's default, 1.0); the turn records the temperature it was sampled at, and learning trains at it.")
    default_turn_type: Literal["main", "side"] = Field("main", description="Turn type of untagged requests.")
    session_idle_timeout_s: float = Field(1800.0, gt=0, description="A session with no request for this long is closed.")
    instant_preferences: bool = Field(True, description="Serve the user's applied preferences at once as a system instruction in the prompt of their main turns (docs/serving.md#the-users-preferences); false: the weights alone answer, whatever was applied.")
    shutdown_grace_s: float = Field(
        3.0, ge=1,
        description="On SIGTERM or Ctrl-C, streams in flight may finish for this long before they are ended "
        "(the learner's work in flight is abandoned at once and redone after a restart), so the process exits "
        "before a container runtime's SIGKILL.",
    )

    @field_validator("api_key", mode="after")
    @classmethod
    def _empty_key_is_none(cls, v: SecretStr | None) -> SecretStr | None:
        return _no_empty_key(v)

    @model_validator(mode="after")
    def _key_off_loopback(self) -> ServingSettings:
        if self.host not in LOOPBACK and self.api_key is None and self.api_keys_file is None:
            raise ValueError(
                f"binding {self.host} exposes the model beyond this machine: set --api-key "
                "(or CLAWBRIDGE_API_KEY, not empty) or api_keys_file so every request must carry a key"
            )
        return self


class JudgeSettings(_Section):
    """Which judges, at which endpoint, with how many votes."""

    judge: Literal["auto", "rules", "http", "backend"] = Field("auto", description="auto: http if --judge-url is set, else the offline rules judge.")
    judge_url: str | None = Field(None, description="OpenAI-compatible endpoint of the judge model.")
    judge_model: str | None = Field(None, description="Judge model name at that endpoint.")
    judge_api_key: SecretStr | None = Field(None, description="Key for the judge endpoint.")
    prm_votes: int = Field(3, ge=1, description="PRM votes per turn (majority; tie -> 0).")
    hint_votes: int = Field(3, ge=1, description="Hint-judge votes per turn (OPD).")
    hint_selection: Literal["longest", "overlap"] = Field("longest", description="How one hint is chosen among accepted ones.")
    redact: bool = Field(False, description="Redact emails, phone numbers and key-like strings in everything sent off the machine (cloud sampling, scoring and training prompts, and the judge endpoint); off by default because it changes what the model sees.")

    @field_validator("judge_api_key", mode="after")
    @classmethod
    def _empty_key_is_none(cls, v: SecretStr | None) -> SecretStr | None:
        return _no_empty_key(v)

    @property
    def kind(self) -> str:
        """`auto` is http when a judge endpoint is configured, else the offline rules judge."""
        if self.judge != "auto":
            return self.judge
        return "http" if self.judge_url else "rules"


class LearningSettings(_Section):
    """What turns judged turns and episodes into advantages (the collector, the episodes)."""

    w_opd: float = Field(1.0, description="Weight of the OPD term in combine.")
    w_rl: float = Field(1.0, description="Weight of the reward term in combine.")
    opd_clip: float = Field(1.0, gt=0, description="Clip of teacher - student logprob gaps.")
    rewrites: int = Field(0, ge=0, le=16, description="Hint-guided rewrites: the teacher (the model with the hint) writes this many answers to a hinted turn's prompt and one of them (rewrite_pick) trains as a demonstration beside the turn (docs/methods.md); 0 turns it off.")
    redraw_max_tokens: int = Field(0, ge=0, description="The most tokens of a draw the learner makes for a turn (a rewrite's teacher draws, the trainer's fresh draws); 0: the turn's own budget (its max_tokens, at least its answer). On a CPU a draw to an agent's 512-token default takes the engine most of a minute (docs/methods.md#hint-guided-rewrites).")
    rewrite_pick: Literal["lift", "surest"] = Field("lift", description="Which finished teacher draw a rewrite trains: lift, the one the hint made likeliest relative to the same model without it, or surest, the teacher's most confident (docs/methods.md).")
    rewrite_min_relevance: float = Field(15.0, description="A rewrite draw must be explained by the question: its teacher log-likelihood (summed nats) with the question at least this far above the same with the question blanked, so echoes of the hint fall below it (docs/methods.md); -1e9 turns the floor off.")
    rewrite_min_lift: float = Field(0.3, description="A rewrite draw must be what the hint asked for: the hint must make it at least this many nats per token likelier, since a draw the hint barely moved is the model's own habit and would pull a student that has passed its teacher back to it (docs/methods.md); -1e9 turns the floor off.")
    w_rewrite: float = Field(1.0, ge=0, description="Advantage of every token of a hint-guided rewrite.")
    w_negative: float = Field(1.0, ge=0, description="Scale of the negative advantages on a turn's own answer; 0 learns only from approved answers, the teacher's gains and rewrites, never pushing a sampled token down (docs/methods.md).")
    kl_anchor: float = Field(0.0, ge=0, description="Anchor to the base model carried in the advantages (A_t -= kl_anchor * (log pi_old - log pi_base) on every trained token), identical on every backend (docs/methods.md); 0 turns it off.")
    episode_timeout_s: float = Field(3600.0, gt=0, description="An episode with no outcome this long after its group opened expires (stored with the reason) and trains nothing.")
    episode_prm_lambda: float = Field(0.0, ge=0, description="Weight of per-step PRM votes in episode rewards (r = outcome + lambda/m * sum(votes)); 0: the outcome alone, with no judge calls.")
    overlong_max_tokens: int = Field(0, ge=0, description="Episode turns longer than this get reward -1 added, ramping in over overlong_cache_tokens before it (DAPO); 0 turns it off.")
    overlong_cache_tokens: int = Field(0, ge=0, description="Length of the overlong penalty's ramp (tokens before overlong_max_tokens).")


class TrainingSettings(_Section):
    """What the trainer reads: the method, the batch, staleness, the loss and optimizer, the LoRA
    shape, checkpoints, and what it does with a held-back candidate."""

    method: Method = Field("combine", description="How judged turns become advantages, and which samples a step trains.")
    teacher: Literal["base", "policy"] = Field("base", description="OPD teacher, given the hint: the frozen base or the live policy; its token logprobs, the rewrites it writes and its top-k distribution (opd_topk) all come from it.")
    batch_size: int = Field(16, ge=1, description="Samples per training step.")
    max_staleness: int = Field(4, ge=0, description="Samples drawn more than this many served versions ago are dropped (a candidate trained on unjudged or held back by the gate never served; without a gate every version serves).")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate of the LoRA parameters.")
    warmup_steps: int = Field(0, ge=0, description="After every fresh optimizer (a new run, a hold-back, a rollback, a resume) the learning rate ramps up linearly over this many steps, because Adam's first step moves every parameter by the full rate whatever its gradient (docs/methods.md#a-warmup-after-every-fresh-optimizer-warmup_steps); 0 turns it off.")
    grad_clip_norm: float = Field(1.0, ge=0, description="Gradient norm clip; 0 disables it.")
    clip_low: float = Field(0.2, ge=0, description="PPO clip below: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO clip above: ratio <= 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the base model (adapter disabled); 0 turns it off.")
    opd_topk: int = Field(0, ge=0, le=1000, description="Top-k distillation: every hinted sample's tokens also learn the teacher's next-token distribution, as KL(policy || teacher) over its top opd_topk tokens plus one bin for the rest (docs/methods.md#top-k-distillation-opd_topk); needs a backend that runs the base model inside its loss (local); 0 turns it off.")
    opd_topk_coef: float = Field(1.0, ge=0, description="Weight of the top-k distillation term in the loss.")
    opd_topk_rewrite: bool = Field(True, description="A hint-guided rewrite also learns the teacher's top-k distribution along its tokens (opd_topk), which helps a held-back lineage back toward the base (docs/methods.md#top-k-distillation-opd_topk); false: the rewrite trains by its advantage alone.")
    opd_draws: int = Field(0, ge=0, le=16, description="On-policy distillation on fresh draws: each step the trained policy answers each hinted sample's prompt this many times more, and those answers learn the teacher's top-k distribution alone (needs opd_topk; docs/methods.md#top-k-distillation-opd_topk); 0 turns it off.")
    opd_draw_max_lift: float | None = Field(None, description="A fresh draw (opd_draws) distils only when the hint makes it no likelier than this (its lift, per token), because distilling along a draw the hint already favours pulls a student that has passed its teacher back to the teacher (docs/methods.md#fresh-draws-the-hint-is-against-opd_draw_max_lift); None: every draw distils.")
    checkpoint_every: int = Field(10, ge=1, description="Save resumable state every N steps.")
    lora_rank: int = Field(32, ge=1, description="LoRA rank (all linear layers).")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (scale alpha/rank).")
    gate_recent: int = Field(8, ge=0, description="The user's recent prompts (of a step's batch) the gate replays on both versions for the judge model to compare pairwise; 0, or the rules judge, turns the comparison off.")
    gate_patience: int = Field(0, ge=0, le=100, description="Held-back candidates in a row that training continues from (the served version keeps serving) before it restarts from the served weights with a fresh optimizer; 0: every hold-back restarts (docs/methods.md#patience-training-on-through-a-held-back-candidate-gate_patience).")
    gate_every: int = Field(1, ge=1, le=100, description="A step's candidate is judged when no full batch waits behind it, or at the latest every gate_every steps; the candidates between are trained on unjudged while the served version keeps serving (docs/methods.md#judged-when-the-learner-catches-up-gate_every); 1: every candidate is judged.")
    gate_blend: tuple[float, ...] = Field((), description="Before a held-back candidate is given up, the gate judges it with its LoRA delta scaled by each of these in turn (0 < alpha < 1: back toward the base) and the first accepted serves; needs a backend that blends (local) (docs/methods.md#a-blend-before-giving-up-gate_blend); empty: off.")

    @field_validator("gate_blend", mode="after")
    @classmethod
    def _blend_toward_the_base(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 < a < 1.0 for a in v):
            raise ValueError(f"gate_blend's alphas scale a candidate's delta back toward the base: each in (0, 1), got {list(v)}")
        return v

    @property
    def loss(self) -> LossSpec:
        return LossSpec(clip_low=self.clip_low, clip_high=self.clip_high, kl_coef=self.kl_coef,
                        topk=self.opd_topk, topk_coef=self.opd_topk_coef, topk_teacher=self.teacher)

    @property
    def optim(self) -> OptimSpec:
        return OptimSpec(learning_rate=self.learning_rate, grad_clip_norm=self.grad_clip_norm)


class GateSettings(_Section):
    """What the gate asks each candidate, and how it decides."""

    gate: Literal["on", "off"] = Field("on", description="Compare every trained candidate with the serving version on probes before it serves (off: publish at once).")
    gate_probes: int = Field(24, ge=0, le=200, description="Questions of the general probe set the gate asks each version (0: only the caller's probes).")
    gate_probes_max: int = Field(50, ge=0, le=200, description="General probe questions asked in all unless the first gate_probes already hold the candidate back beyond doubt; a candidate is accepted only on all of them, and gate_probes or less never asks more.")
    gate_samples: int = Field(1, ge=1, description="Answers per probe and version.")
    gate_margin: float = Field(0.05, ge=0, le=1, description="A candidate worse than this (a rate difference) with p < gate_alpha is held back.")
    gate_alpha: float = Field(0.1, gt=0, lt=1, description="Significance of the gate's one-sided paired test.")
    gate_alpha_base: float = Field(0.2, gt=0, lt=1, description="Significance of the comparisons with v0, the base: they guard what all the steps together cost, so the test is stricter.")
    gate_v0_test: Literal["non_inferiority", "harm"] = Field("non_inferiority", description="What the comparison with v0 asks: non_inferiority (a candidate serves only when shown to lose less than gate_margin, p < gate_alpha_base) or harm (held back only when shown to lose more, so more candidates serve).")
    gate_reference: Literal["twin", "v0"] = Field("twin", description="What the general probe is judged against: twin, the base model asked for the user's standing preferences (paying their price is not harm; falling more than gate_margin below the twin is), or v0, strictly no worse than the base model (gate_v0_test decides).")
    gate_max_price: float = Field(0.15, ge=0, le=1, description="The most general-probe answers (a rate) the preferences may cost, and the most a served version may fall below v0; raising it consents to a higher price.")
    gate_reference_samples: int = Field(2, ge=1, description="Answers per probe of v0 and the twin, asked once for every candidate: the more, the fewer wrong decisions (docs/methods.md#harm-is-judged-against-what-you-asked-for).")
    gate_max_tokens: int = Field(64, ge=1, description="max_tokens of a probe answer.")
    gate_temperature: float = Field(0.7, gt=0, description="Temperature of probe answers.")
    retire_share: float = Field(0.6, gt=0, description="An applied preference's instruction is retired (the preference is learned) when a served version's weights alone carry this share of its pull: 1 - KL(twin || version) / KL(twin || base) on the twin's answers to the user's recent prompts. Past one half the weights alone are nearer the twin than the weights with the instruction on top, which over-shoot (docs/methods.md#the-weights-later).")
    restore_share: float = Field(0.4, ge=0, description="A learned preference's instruction comes back when a later served version carries less than this share of it.")
    retire_samples: int = Field(2, ge=1, description="The twin's answers per recent prompt that the share is measured on.")


class EngineSettings(_Section):
    """The embedded torch engine (the local backend on a CPU or one GPU; docs/engine.md)."""

    prefix_cache_mb: int = Field(2048, ge=0, description="Memory for the KV of recent prompts, reused when a new prompt shares their prefix (0: off).")
    engine_max_batch: int = Field(16, ge=1, le=256, description="Requests decoded together (more wait their turn): more rows raise throughput but slow each stream, and an agent's long prompts hold that many rows of KV (docs/engine.md).")
    engine_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="On a CPU, the arithmetic of the base model's matmuls: bf16 (bf16 linear weights in an fp32 model: faster, with scores close to but not bit-equal to the sampled logprobs), fp32 (exact logprobs), or auto, bf16 where the CPU multiplies bf16 natively (docs/engine.md).")
    engine_merge_adapters: bool = Field(True, description="On a CPU in bf16, a forward whose rows all run on one served version uses that adapter merged into the bf16 weights instead of the base weights plus LoRA products, for a faster decode at a slightly larger logprob error (docs/engine.md); false: always the base weights plus the adapter.")
    engine_user_first: bool = Field(True, description="A user's request goes ahead of the learner's own work on the engine it shares: admitted before background sampling (a background row paused when the batch is full), no background job started while it runs, a training step paused between micro-batches (docs/engine.md#the-user-first); false: every request and job in arrival order.")
    engine_background_share: float = Field(0.25, ge=0.0, lt=1.0, description="With engine_user_first, the share of a busy engine's time the learner still gets while users' requests run back to back, in bursts of half a second (a user's request then takes about 1 / (1 - share) its time alone; docs/engine.md#the-user-first); 0: the learner waits until no user's request is in flight.")
    adapter_memory_mb: int = Field(1024, ge=0, description="Memory for registered LoRA adapters served beside the engine's own versions (requests that name an adapter): beyond it the least recently used is evicted to the data directory's adapter-cache and read back on its next request (docs/engine.md).")


class CloudSettings(_Section):
    """The cloud backends (docs/backends.md)."""

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


class GpuSettings(_Section):
    """The local GPU layout (SGLang + FSDP2)."""

    num_gpus: int | None = Field(None, ge=0, description="GPUs to use (default: all visible).")
    actor_gpus: int | None = Field(None, ge=0, description="GPUs for the FSDP2 trainer (default: half).")
    rollout_gpus: int | None = Field(None, ge=0, description="GPUs for the policy SGLang server(s).")
    prm_gpus: int | None = Field(None, ge=0, description="GPUs for the judge SGLang server.")


class SpoolSettings(_Section):
    """The writes the store cannot take (docs/store.md#when-the-store-is-down)."""

    spool_dir: Path | None = Field(None, description="Where writes the store cannot take (down, full disk, locked) wait, fsynced, until it is back (default: spool/ in the data directory). For a SQLite store on a disk that may fill, a path on another filesystem.")
    spool_max_mb: int = Field(256, ge=1, description="The spool's size limit; past it new turns are not recorded (counted as lost) or, with spool_full 503, requests are refused.")
    spool_full: Literal["drop", "503"] = Field("drop", description="When the spool is full: drop (answer, and count the turns that cannot be recorded as lost: availability) or 503 (refuse new requests until it has room: durability).")
    store_write_timeout_s: float = Field(5.0, gt=0, description="A write the store has not committed in this time goes to the spool, so a hung connection stalls no request.")

SECTIONS: dict[str, type[_Section]] = {
    "serving": ServingSettings, "judging": JudgeSettings, "learning": LearningSettings,
    "training": TrainingSettings, "gating": GateSettings, "engine": EngineSettings,
    "cloud": CloudSettings, "gpus": GpuSettings, "spool": SpoolSettings,
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", validate_default=True, frozen=True)

    backend: BackendName = Field("local", description="Training and serving platform.")
    model: str = Field("smollm2-135m-instruct", description="Registry name (smollm2-135m-instruct, tiny-random), a local HF directory, or the platform's base model name.")
    data_dir: Path = Field(Path(".clawbridge"), description="Store, adapters, checkpoints, logs.")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Where the embedded model is materialised.")
    db: str | None = Field(None, description="SQLAlchemy URL; default SQLite (WAL) in the data directory.")
    train: bool = Field(True, description="Judge and train in the background (false: serve and capture only).")
    seed: int = Field(0, description="Seed of the LoRA initialisation, the judges' votes, the gate's questions and the demo.")
    budget_usd: float | None = Field(None, ge=0, description="Stop training (never serving) when spend reaches this.")
    resume: bool = Field(False, description="Has no effect: every start continues from the newest published version (and its checkpoint when it has one).")

    serving: ServingSettings = Field(default_factory=lambda: ServingSettings.model_validate({}))
    judging: JudgeSettings = Field(default_factory=lambda: JudgeSettings.model_validate({}))
    learning: LearningSettings = Field(default_factory=lambda: LearningSettings.model_validate({}))
    training: TrainingSettings = Field(default_factory=lambda: TrainingSettings.model_validate({}))
    gating: GateSettings = Field(default_factory=lambda: GateSettings.model_validate({}))
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings.model_validate({}))
    cloud: CloudSettings = Field(default_factory=lambda: CloudSettings.model_validate({}))
    gpus: GpuSettings = Field(default_factory=lambda: GpuSettings.model_validate({}))
    spool: SpoolSettings = Field(default_factory=lambda: SpoolSettings.model_validate({}))

    def __init__(self, **values: Any) -> None:
        """Flat names (`batch_size=8`) or sections (`training={...}`); the environment fills the rest."""
        super().__init__(**nest(values))

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _FlatEnvironment(settings_cls)

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite:///{(self.data_dir / 'clawbridge.db').resolve()}"

    @property
    def loss(self) -> LossSpec:
        return self.training.loss

    @property
    def optim(self) -> OptimSpec:
        return self.training.optim

    def recipe(self) -> LearningRecipe:
        """The learning recipe of the model these settings train (what `load` put beneath them)."""
        return recipe_for(self.backend, trained_model(self.backend, self.model, self.cloud.model_dump()))

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name (JSON values): what a config file of these settings holds."""
        dumped = self.model_dump(mode="json")
        return {name: (dumped[sec][name] if sec else dumped[name]) for name, sec in FLAT.items()}

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Flags (`overrides`, by flat name; None means not given) > environment > config file > the
        model's learning recipe (`recipes.recipe_for`: what `clawbridge up` learns with) > defaults."""
        file_values: dict[str, Any] = {}
        if config_file is not None:
            text = config_file.read_text()
            if config_file.suffix in {".yaml", ".yml"}:
                import yaml

                file_values = yaml.safe_load(text) or {}
            else:
                file_values = json.loads(text)
            if not isinstance(file_values, dict):
                raise ValueError(f"{config_file}: settings are a mapping of names to values")
        merged = _deep_update(nest(file_values), environment_values())
        merged = _deep_update(merged, nest({k: v for k, v in overrides.items() if v is not None}))
        return cls(**_deep_update(nest(dict(learning_recipe(merged).values)), merged))


def learning_recipe(values: Mapping[str, Any]) -> LearningRecipe:
    """The learning recipe of the model `values` (nested, as given: file, environment, flags)
    train, on their backend (`recipes.recipe_for`); the defaults fill what they do not say."""
    backend = values.get("backend", Settings.model_fields["backend"].default)
    model = values.get("model", Settings.model_fields["model"].default)
    cloud = {**{k: f.default for k, f in CloudSettings.model_fields.items()}, **values.get("cloud", {})}
    return recipe_for(backend, trained_model(backend, model, cloud))


def _fields_by_flat_name() -> dict[str, str | None]:
    out: dict[str, str | None] = {name: None for name in Settings.model_fields if name not in SECTIONS}
    for sec, model in SECTIONS.items():
        for name in model.model_fields:
            if name in out or name in SECTIONS:
                raise TypeError(f"setting {name!r} is declared twice ({sec} and {out.get(name) or 'Settings'})")
            out[name] = sec
    return out


FLAT: dict[str, str | None] = _fields_by_flat_name()  # flat name -> its section (None: on Settings)


def field_info(name: str) -> FieldInfo:
    """The declaration of the setting with flat name `name`."""
    sec = FLAT[name]
    return (SECTIONS[sec] if sec else Settings).model_fields[name]


def nest(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flat names moved into their sections; sections given as mappings kept (a name given both
    ways fails). Unknown names stay where they are, for validation to refuse."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        sec = FLAT.get(key)
        if key in SECTIONS and isinstance(value, Mapping):
            target = out.setdefault(key, {})
            if not isinstance(target, dict):
                raise ValueError(f"settings section {key!r} given twice")
            for name, v in value.items():
                if name in target:
                    raise ValueError(f"setting {name!r} given twice (flat and under {key!r})")
                target[name] = v
        elif sec is not None:
            target = out.setdefault(sec, {})
            if not isinstance(target, dict):
                out[key] = value  # beside a section object: validation refuses the flat name
                continue
            if key in target:
                raise ValueError(f"setting {key!r} given twice (flat and under {sec!r})")
            target[key] = value
        else:
            out[key] = value
    return out


def _deep_update(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _is_sequence(name: str) -> bool:
    origin = typing.get_origin(field_info(name).annotation)
    return origin in (tuple, list)


def environment_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the environment sets (`CLAWBRIDGE_<FLAT NAME>`, and `PORT`), nested.
    A list-valued setting is JSON (`CLAWBRIDGE_GATE_BLEND='[0.75, 0.5]'`)."""
    env = os.environ if environ is None else environ
    flat: dict[str, Any] = {}
    for name in FLAT:
        for var in (f"{ENV_PREFIX}{name.upper()}", *(("PORT",) if name == "port" else ())):
            if var in env:
                flat[name] = json.loads(env[var]) if _is_sequence(name) else env[var]
                break
    return nest(flat)


class _FlatEnvironment(PydanticBaseSettingsSource):
    """The environment by flat names, for `Settings(...)` built without `load`."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return environment_values()


def problems(e: ValidationError) -> str:
    """A settings validation error in the user's words: each setting by its flat name."""
    out = []
    for err in e.errors():
        name = str(err["loc"][-1]) if err["loc"] else "settings"
        if err["type"] == "extra_forbidden":
            out.append(f"unknown setting {name!r} (docs/configuration.md lists them)")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            out.append(msg if name in SECTIONS or name == "settings" else f"{name}: {msg}")
    return "; ".join(out)


def _no_empty_key(v: SecretStr | None) -> SecretStr | None:
    # `CLAWBRIDGE_API_KEY=` (a compose file leaving it blank) is no key, never a key "".
    return v if v is not None and v.get_secret_value().strip() else None
