"""The agentic demo (`clawbridge demo --scenario tools`): the task and its outcome checker, and an
end-to-end run on the tiny random model (real server, the SDK's groups, GRPO samples, a training
step, the gate, the held-out evaluation). The learning run on the embedded model is `slow`."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from clawbridge.demo import tools
from clawbridge.demo.recipe import TOOLS_RECIPE
from clawbridge.demo.tools import Call, Task, ToolsScenario, Transcript, grade

SC = ToolsScenario()


def test_the_builtin_scenario_holds_disjoint_names_and_codes_nobody_can_guess():
    sc = tools.load("tools")
    assert sc is not None and sc.kind == "tools"
    assert not {n.lower() for n in sc.train_names} & {n.lower() for n in sc.heldout_names}
    codes = [sc.code(n) for n in sc.train_names + sc.heldout_names]
    assert all(len(c) == 4 and c.isdigit() for c in codes)
    assert len(set(codes)) > 0.9 * len(codes)
    assert sc.example.code not in {sc.code(n) for n in sc.heldout_names}
    assert sc.code("Maya") == sc.code("maya")  # a hash of the name: the same in every run
    assert tools.load("concise") is None  # a preference scenario stays with the other runner


def test_a_scenario_file_with_kind_tools_loads_and_overlap_is_refused(tmp_path: Path):
    f = tmp_path / "mine.yaml"
    f.write_text("kind: tools\nname: mine\ntrain_names: [Ann, Bo]\nheldout_names: [Cy, Di]\n")
    sc = tools.load(f)
    assert (
        sc is not None and sc.name == "mine" and [t.name for t in sc.heldout_tasks] == ["Cy", "Di"]
    )
    f.write_text("kind: tools\ntrain_names: [Ann, Bo]\nheldout_names: [ann, Di]\n")
    with pytest.raises(ValueError, match="held-out names"):
        tools.load(f)
    other = tmp_path / "pref.yaml"
    other.write_text("name: pref\n")
    assert tools.load(other) is None


def test_the_conversation_opens_with_one_worked_example_then_the_question():
    task = SC.task("Maya", 0)
    msgs = SC.messages(task)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert msgs[2]["tool_calls"][0]["function"] == {
        "name": "lookup",
        "arguments": '{"name": "Zoe"}',
    }
    assert msgs[3]["content"] == "Zoe's secret code is 4821."
    assert msgs[-1]["content"] == "What is Maya's secret code?"


def test_the_lookup_tool_answers_known_names_and_says_what_is_wrong():
    code = SC.code("Steve")
    assert SC.run_tool("lookup", '{"name": " steve "}') == (
        f"Steve's secret code is {code}.",
        "steve",
        True,
    )
    assert SC.run_tool("lookup", '{"name": "Nobody"}')[2] is False
    assert SC.run_tool("lookup", "{name: Steve}")[0].startswith("error: arguments are not JSON")
    assert SC.run_tool("lookup", '{"who": "Steve"}')[0].startswith("error: lookup needs")
    assert SC.run_tool("search", "{}")[0].startswith("error: unknown tool")


def _transcript(
    answer: str, finish: str = "stop", calls: tuple[tuple[str, bool], ...] = ()
) -> Transcript:
    task = Task("Steve", "What is Steve's secret code?", "1234")
    return Transcript(
        task, [Call("lookup", "{}", "", who, ok) for who, ok in calls], answer, finish
    )


@pytest.mark.parametrize(
    ("answer", "finish", "calls", "success", "clean", "looked_up", "reward"),
    [
        ("Steve's secret code is 1234.", "stop", (("Steve", True),), True, True, True, 1.0),
        ("Steve's secret code is 1234", "length", (("steve", True),), True, False, True, 1.0),
        ("It is 1234.", "stop", ((None, False), ("Steve", True)), True, False, True, 1.0),
        (
            "Steve's secret code is 4821.",
            "stop",
            (),
            False,
            False,
            False,
            0.0,
        ),  # the example's code
        ("1234 or 4821", "stop", (("Steve", True),), False, False, True, 0.2),  # two codes: no
        ("Code 12345.", "stop", (("Steve", True),), False, False, True, 0.2),  # not the number
        ("", "tool_calls", (("Steve", True),), False, False, True, 0.0),  # the steps ran out: no credit
        ("", "tool_calls", (("Steve", True), ("Steve", True)), False, False, True, 0.0),  # a loop
        ("Steve's secret code is 1234.", "stop", (("Zack", True),), True, True, False, 1.0),
    ],
)
def test_the_outcome_checker(answer, finish, calls, success, clean, looked_up, reward):
    g = grade(_transcript(answer, finish, calls), 0.2)
    assert (g.success, g.clean, g.looked_up, g.reward) == (success, clean, looked_up, reward)


def test_the_recipe_gates_on_its_own_probes_and_never_asks_the_rest(tmp_path: Path):
    settings = tools.tools_settings(SC, tmp_path)
    assert settings.gating.gate_probes == settings.gating.gate_probes_max == TOOLS_RECIPE["gate_probes"]
    wider = SC.model_copy(update={"recipe": SC.recipe.updated(gate_probes_max=50)})
    assert tools.tools_settings(wider, tmp_path).gating.gate_probes_max == 50


def test_an_episode_is_a_lookup_and_an_answer_so_a_second_lookup_runs_out_of_steps():
    assert SC.recipe.max_steps == 2
    looped = _transcript("", "tool_calls", (("Steve", True), ("Steve", True)))
    assert grade(looped, SC.recipe.partial_credit).reward == 0.0


TINY = {
    "n": 2,
    "groups": 2,
    "rounds": 1,
    "batch_size": 2,
    "max_tokens": 6,
    "max_steps": 2,
    "eval_samples": 1,
    "probe": False,
    "gate_probes": 2,
    "extra_groups": 10,  # the length checker gives equal outcomes to a 2-episode group half the time
    "lora_rank": 4,
    "hint": "Call lookup first, with {name}.",
}


async def test_the_tools_demo_runs_end_to_end_on_the_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The tiny random model never solves a task (all groups would be dropped), so this test's
    checker scores the answer's length: outcomes differ within a group and a step trains."""
    real = tools.grade

    def by_length(t: Transcript, partial: float) -> tools.Grade:
        g = real(t, partial)
        return tools.Grade(g.success, g.clean, g.looked_up, float(len(t.answer) % 2))

    monkeypatch.setattr(tools, "grade", by_length)
    sc = SC.model_copy(
        update={"heldout_names": SC.heldout_names[:3], "recipe": SC.recipe.updated(**TINY)}
    )
    settings = tools.tools_settings(sc, tmp_path / "data", model="tiny-random")
    result = await tools.run_tools_demo(sc, settings, plot_path=tmp_path / "tools.png")
    s = result.summary()
    for key in (
        "solved_before",
        "solved_after",
        "solved_interval",
        "clean_before",
        "clean_after",
        "looked_up_before",
        "looked_up_after",
        "probe_before",
        "probe_after",
        "episodes_to_80",
        "gate",
        "versions",
    ):
        assert key in s
    # the preference demo's measures keep their own names; none is reused with another meaning
    assert not {"truly_before", "on_topic_before", "before", "interval"} & s.keys()
    assert s["scenario"] == "tools" and s["heldout_tasks"] == 3 and s["eval_samples"] == 1
    assert s["versions"][0]["version"] == 0 and len(s["versions"]) == 2
    assert s["train_episodes"] >= 4 and s["steps"] >= 1
    assert len(s["examples"]) == 3 and all("answer [" in ex["before"] for ex in s["examples"])
    assert Path(s["plot"]).exists()
    json.dumps(s)
    # no episode looked the name up: each first step got the agent's hint, and trained with hint OPD
    with sqlite3.connect(tmp_path / "data" / "clawbridge.db") as db:
        hints = db.execute("SELECT hint FROM judgments WHERE kind = 'feedback'").fetchall()
        opd = db.execute(
            "SELECT count(*) FROM samples WHERE teacher_logprobs IS NOT NULL"
        ).fetchone()[0]
    assert hints and all(h.startswith("Call lookup first, with ") for (h,) in hints)
    assert opd >= 1


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the full demo: about 10-12 min on 2 busy cores (docs/measurements.md)
async def test_the_embedded_model_learns_to_use_the_tool(tmp_path: Path):
    sc = ToolsScenario()
    result = await tools.run_tools_demo(sc, tools.tools_settings(sc, tmp_path / "data"))
    assert result.last.solved - result.first.solved >= 0.25 and result.improved, result.summary()
