"""The GPU plan for 8, 4, 2, 1 and 0 GPUs, explicit splits, and the JSON the CLI prints."""

from __future__ import annotations

import json

import pytest
from clawbridge.local_gpu.layout import LayoutError, plan, render_plan, validate_visible


def roles(n: int, *split: int | None) -> dict[str, list[int]]:
    return json.loads(render_plan(plan(n, *split), json=True))["roles"]


def test_eight_gpus_default_to_four_actor_two_rollout_two_prm():
    assert roles(8) == {"actor": [0, 1, 2, 3], "rollout": [4, 5], "prm": [6, 7]}


def test_four_gpus_split_two_one_one():
    assert roles(4) == {"actor": [0, 1], "rollout": [2], "prm": [3]}


def test_two_gpus_train_on_one_and_serve_the_policy_and_judge_on_the_other():
    p = plan(2)
    assert roles(2) == {"actor": [0], "rollout": [1], "prm": []}
    assert [x.name for x in p.processes] == ["proxy", "policy-sglang", "trainer"]
    assert "judge" in next(x for x in p.processes if x.name == "policy-sglang").detail


def test_one_gpu_colocates_sglang_with_a_memory_fraction_beside_the_trainer():
    p = plan(1, gpu_memory_gib=80)
    assert p.mode == "colocated"
    assert roles(1) == {"actor": [0], "rollout": [0], "prm": [0]}
    (budget,) = p.memory
    uses = dict(budget.uses)
    assert uses["policy-sglang"] == pytest.approx(32.0)
    assert 0 < uses["trainer"] < 80 - 32
    assert "--mem-fraction-static 0.4" in next(x for x in p.processes if x.name == "policy-sglang").detail


def test_zero_gpus_is_the_cpu_plan_with_empty_roles():
    p = plan(0)
    assert p.mode == "cpu"
    assert roles(0) == {"actor": [], "rollout": [], "prm": []}
    assert p.memory == ()
    assert "CPU" in render_plan(p)


def test_explicit_split_is_honoured_and_leftover_gpus_are_reported():
    p = plan(8, 2, 2, 2)
    assert p.roles == {"actor": (0, 1), "rollout": (2, 3), "prm": (4, 5)}
    assert any("unused" in n for n in p.notes)


def test_a_split_larger_than_the_gpus_is_refused_with_the_fix():
    with pytest.raises(LayoutError, match="exceeds NUM_GPUS=4"):
        plan(4, 4, 2, 2)


def test_roles_on_zero_gpus_are_refused():
    with pytest.raises(LayoutError):
        plan(0, 1, None, None)


def test_trainer_memory_shrinks_with_more_actor_gpus():
    one = dict(plan(2).memory[0].uses)["trainer"]
    four = dict(plan(8).memory[0].uses)["trainer"]
    assert four < one


def test_every_process_has_its_own_port_and_gpu_roles_do_not_overlap_in_split_mode():
    p = plan(8)
    ports = [x.port for x in p.processes]
    assert len(set(ports)) == len(ports)
    all_gpus = [g for r in p.roles.values() for g in r]
    assert len(set(all_gpus)) == len(all_gpus) == 8


def test_a_plan_needing_more_gpus_than_visible_is_refused():
    with pytest.raises(LayoutError, match="only 2 GPU"):
        validate_visible(plan(8), 2)
    validate_visible(plan(0), 0)


def test_text_plan_names_each_process_gpus_and_memory():
    text = render_plan(plan(8))
    assert "policy-sglang" in text and "GPUs [4, 5]" in text and "port 30010" in text
    assert "GPU 7: judge-sglang 68.0" in text


def test_plan_command_prints_json_roles_for_the_gpu_count_given():
    from clawbridge.cli.main import app
    from typer.testing import CliRunner

    out = CliRunner().invoke(app, ["plan", "--gpus", "4", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["roles"] == {"actor": [0, 1], "rollout": [2], "prm": [3]}
    bad = CliRunner().invoke(app, ["plan", "--gpus", "2", "--actor-gpus", "3"])
    assert bad.exit_code == 2
