"""The store (docs/design.md#the-store): sessions, turns with exact token ids and logprobs, judgments with
every vote, samples and their states, training steps and policy versions. SQLite (WAL) by
default, PostgreSQL by URL; Alembic migrations run at open. See docs/store.md."""

from clawbridge.store.base import SampleStateError, StoreError, VersionReused
from clawbridge.store.continuation import Continuation, KeyedTurn
from clawbridge.store.core import Store
from clawbridge.store.episodes import EpisodeError, EpisodeRow, GroupRow, NewEpisode
from clawbridge.store.history import GateRecord, History, Preference
from clawbridge.store.lease import LeaseRow, StoreInUse
from clawbridge.store.records import (
    DEFAULT_USER,
    JudgeVote,
    Judgment,
    PolicyVersionRow,
    Rewrite,
    Sample,
    SessionRow,
    StoredTurn,
    StoreStats,
    TrainingStep,
    TurnRecord,
)
from clawbridge.store.training import TRANSITIONS
from clawbridge.store.users import Deleted, UserCounts
from clawbridge.store.writer import AsyncWriter, WriterClosed

__all__ = [
    "DEFAULT_USER",
    "TRANSITIONS",
    "AsyncWriter",
    "Continuation",
    "Deleted",
    "EpisodeError",
    "EpisodeRow",
    "GateRecord",
    "GroupRow",
    "History",
    "JudgeVote",
    "Judgment",
    "KeyedTurn",
    "LeaseRow",
    "NewEpisode",
    "PolicyVersionRow",
    "Preference",
    "Rewrite",
    "Sample",
    "SampleStateError",
    "SessionRow",
    "Store",
    "StoreError",
    "StoreInUse",
    "StoreStats",
    "StoredTurn",
    "TrainingStep",
    "TurnRecord",
    "UserCounts",
    "VersionReused",
    "WriterClosed",
]
