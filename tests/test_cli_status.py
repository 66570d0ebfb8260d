"""`clawbridge versions`, `status` and `preferences`: the gate's decisions and the price of the
preferences, read from the store."""

from __future__ import annotations

from clawbridge.cli.preferences import print_preferences
from clawbridge.cli.status import print_status, print_versions
from clawbridge.config import Settings
from clawbridge.learning import preferences as prefs
from clawbridge.learning.gate import GateDecision
from clawbridge.store import GateRecord, PolicyVersionRow, Store


def test_versions_and_status_show_the_gate_decisions(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps the table to the terminal's width
    settings = Settings(data_dir=tmp_path)
    tmp_path.mkdir(exist_ok=True)
    with Store.open(settings.db_url) as store:
        for v in (1, 2, 3):
            store.record_policy_version(PolicyVersionRow(version=v, step=v if v < 3 else None,
                                                         copy_of=1 if v == 3 else None))
        decisions = [GateDecision(1, 0, "accepted", "ok", {"probe_candidate": 0.8}),
                     GateDecision(2, 1, "rejected", "probe vs serving: 20% vs 80% (-60 pts, p=0.001)",
                                  {"probe_candidate": 0.2})]
        for d in decisions:
            store.record_gate_decision(GateRecord.of(d.record()))
    print_versions(str(tmp_path), None)
    out = capsys.readouterr().out
    assert "accepted (probe 80%)" in out and "rejected by the gate" in out and "rollback of v1" in out
    print_status(str(tmp_path), None)
    assert "1 accepted, 1 held back" in capsys.readouterr().out


def test_the_price_and_the_preferences_are_shown_wherever_versions_are(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    settings = Settings(data_dir=tmp_path)
    print_preferences(str(tmp_path), None)
    assert "no preferences yet" in capsys.readouterr().out
    known = prefs.merge([], [("Answer in one short sentence.", "t1"), ("Use bullet points.", "t2"),
                             ("answer in ONE short sentence", "t3")], version=1)
    figures = {"probe_candidate": 0.5, "probe_twin": 0.5, "probe_v0": 0.62, "price_points": 12.0}
    with Store.open(settings.db_url) as store:
        store.record_policy_version(PolicyVersionRow(version=1, step=1))
        store.save_preferences(known)
        store.record_gate_decision(GateRecord.of(GateDecision(1, 0, "accepted", "ok", figures, "twin",
                                                              prefs.wanted_instruction(known)).record()))
    print_preferences(str(tmp_path), None)
    out = capsys.readouterr().out
    # heard twice and about length: applied; heard once: heard (the shortest wording kept)
    assert "answer in ONE short sentence" in out and "applied" in out and "length" in out
    assert "Use bullet points." in out and "heard" in out and "served as an instruction now: answer in ONE" in out
    assert "price: 12 pts of general answers (v0 62%, asked for it 50%)" in out
    print_versions(str(tmp_path), None)
    assert "twin 50%, v0 62%: price 12 pts" in capsys.readouterr().out
    print_status(str(tmp_path), None)
    out = capsys.readouterr().out
    assert "12 pts of general answers" in out and "1 applied · 1 heard; served now: answer in ONE short sentence" in out
