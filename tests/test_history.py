"""The typed version history (store.history()): gate decisions, version origins and preferences,
and the migration that carries a data directory whose history was JSON in `meta` over
(tests/fixtures/history_0006, made by tests/fixtures/make_history_0006.py at revision 0006)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from clawbridge.store import GateRecord, History, PolicyVersionRow, Preference, Store
from clawbridge.store.base import alembic_config

FIXTURE = Path(__file__).parent / "fixtures" / "history_0006"
OLD_KEYS = ("gate.decisions", "policy.rollbacks", "policy.blends", "learning.preferences")
TWIN = "twin"
REASON_REJECTED = "validation vs serving: 0% vs 100% (-100 pts, p=0.000)"
REASON_ACCEPTED = "no probe group is worse beyond the margin, and each is within it of v0"


def _expect_fixture(h: History) -> None:
    """What the fixture's run recorded: v1 rejected, its blends v2 (x0.9) rejected and v3 (x1e-6)
    accepted; v4 a rollback to v0; v5 trained from v4 and accepted; two preferences."""
    assert [(d.candidate, d.serving, d.decision) for d in h.decisions] == [
        (1, 0, "rejected"), (2, 0, "rejected"), (3, 0, "accepted"), (5, 4, "accepted")]
    assert [d.reason for d in h.decisions] == [REASON_REJECTED, REASON_REJECTED, REASON_ACCEPTED, REASON_ACCEPTED]
    assert all(d.reference == TWIN and d.created_at is None for d in h.decisions)
    assert h.decisions[0].figures["validation_candidate"] == 0.0 and h.decisions[0].figures["probes_asked"] == 6.0
    assert h.decisions[0].asked == "Too long. Please answer in one short sentence."
    assert h.decisions[3].asked == "Please use bullet points next time.\nToo long, answer in one short sentence."
    assert h.copies == {4: 0} and h.blends == {3: (1, 1e-6)}
    assert [(p.text, p.count, len(p.turns), p.first_version) for p in h.preferences] == [
        ("Too long, answer in one short sentence.", 2, 2, 1), ("Please use bullet points next time.", 1, 1, 5)]
    assert h.same_weights(4, 0) and not h.same_weights(5, 0)
    assert h.decision(5) is not None and h.decision(4) is None


def test_a_data_directory_made_at_0006_opens_with_its_history_carried_over(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    url = f"sqlite:///{data / 'clawbridge.db'}"
    with sa.create_engine(url).connect() as conn:  # the fixture is what the old code left
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "0006"
        assert {r[0] for r in conn.execute(sa.text("SELECT key FROM meta"))} >= set(OLD_KEYS)
    with Store.open(url) as store:
        _expect_fixture(store.history())
        assert all(store.get_meta(k) is None for k in OLD_KEYS)
        assert store.get_meta("trainer.checkpoint")["version"] == 4  # other meta stays
        assert [(v.version, v.step, v.copy_of, v.blend_of) for v in store.versions()] == [
            (1, 1, None, None), (3, None, None, 1), (4, None, 0, None), (5, 2, None, None)]
    with Store.open(url) as store:  # opening again migrates nothing
        _expect_fixture(store.history())


def _fixture_rows() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The fixture's meta and policy_versions rows, as the old code wrote them."""
    with sa.create_engine(f"sqlite:///{FIXTURE / 'clawbridge.db'}").connect() as conn:
        md = sa.MetaData()
        meta = sa.Table("meta", md, autoload_with=conn)
        versions = sa.Table("policy_versions", md, autoload_with=conn)
        meta_rows = [{**r._asdict(), "updated_at": datetime.now(UTC)} for r in conn.execute(
            sa.select(meta.c.key, sa.type_coerce(meta.c.value, sa.JSON()).label("value")))]
        version_rows = [{**r._asdict(), "created_at": datetime.now(UTC)} for r in conn.execute(
            sa.select(versions.c.version, versions.c.path, versions.c.step, versions.c.mean_reward, versions.c.samples))]
    return meta_rows, version_rows


def test_the_migration_carries_the_history_over_and_back(db_url: str) -> None:
    """The fixture's history, written at 0006 into a fresh store (SQLite or PostgreSQL), reads
    back the same after the upgrade; a downgrade writes the meta lists back."""
    meta_rows, version_rows = _fixture_rows()
    s = Store.open(db_url, migrate=False)
    s.migrate("0006")
    with s.engine.begin() as conn:
        md = sa.MetaData()
        meta = sa.Table("meta", md, autoload_with=conn)
        versions = sa.Table("policy_versions", md, autoload_with=conn)
        conn.execute(meta.insert(), meta_rows)
        conn.execute(versions.insert(), version_rows)
    s.migrate()
    _expect_fixture(s.history())
    assert all(s.get_meta(k) is None for k in OLD_KEYS)
    with s.engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0006")
    old = {r["key"]: r["value"] for r in meta_rows}
    with s.engine.connect() as conn:
        md = sa.MetaData()
        meta = sa.Table("meta", md, autoload_with=conn)
        back = dict(conn.execute(sa.select(meta.c.key, sa.type_coerce(meta.c.value, sa.JSON()))).all())
    assert {k: back[k] for k in OLD_KEYS} == {k: old[k] for k in OLD_KEYS}
    s.migrate()
    _expect_fixture(s.history())
    s.close()


def test_decisions_append_and_the_newest_on_a_version_counts(store: Store) -> None:
    assert store.history() == History()
    store.record_gate_decision(GateRecord(1, 0, "rejected", "gate failed: Boom"))
    store.record_gate_decision(GateRecord.of({"version": 1, "serving": 0, "decision": "accepted", "reason": "ok",
                                              "figures": {"probe_candidate": 0.5}, "reference": "v0", "asked": None}))
    h = store.history()
    assert [d.decision for d in h.decisions] == ["rejected", "accepted"]
    assert h.decision(1) == h.decisions[-1] and h.by_version() == {1: h.decisions[-1]}
    assert h.decisions[-1].as_json() == {"version": 1, "serving": 0, "decision": "accepted", "reason": "ok",
                                         "figures": {"probe_candidate": 0.5}, "reference": "v0", "asked": None}
    assert all(d.created_at is not None for d in h.decisions)


def test_version_origins_are_columns_of_their_rows(store: Store) -> None:
    store.record_policy_version(PolicyVersionRow(version=1, step=1))
    store.record_policy_version(PolicyVersionRow(version=2, copy_of=0))
    store.record_policy_version(PolicyVersionRow(version=3, blend_of=1, blend_alpha=0.5))
    store.record_policy_version(PolicyVersionRow(version=4, copy_of=2))
    h = store.history()
    assert h.copies == {2: 0, 4: 2} and h.blends == {3: (1, 0.5)}
    assert h.same_weights(4, 0) and not h.same_weights(3, 1)


def test_preferences_keep_their_order_and_update_in_place(store: Store) -> None:
    first = [Preference("be brief", 1, ("a",), 1), Preference("use lists", 1, ("b",), 1)]
    stored = store.save_preferences(first)
    assert [p.id for p in stored] == [1, 2]  # numbered by the store, first heard first
    more = [replace(stored[0], text="brief", count=2, turns=("a", "c")), stored[1], Preference("in French", 1, ("d",), 2)]
    store.save_preferences(more)
    assert store.history().preferences == tuple(replace(p, id=i + 1) for i, p in enumerate(more))
