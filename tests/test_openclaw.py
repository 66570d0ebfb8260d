"""OpenClaw integration: the config writer and the plug-in's files (no Node needed), the CLI
against a temporary home, the plug-in driven by Node against a live clawbridge. A real OpenClaw
on the default model is tests/test_openclaw_real.py (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from clawbridge.cli.main import app
from clawbridge.config import Settings
from clawbridge.openclaw import provider as oc
from clawbridge.server import build_backend
from clawbridge.store.export import iter_export
from live_server import LiveServer
from typer.testing import CliRunner

PROVIDER = oc.provider_entry("http://127.0.0.1:30000", "tiny-random")
USER_CONFIG = {
    "gateway": {"mode": "local", "port": 18789},
    "models": {"providers": {"openai": {"baseUrl": "https://api.openai.com/v1", "models": []}}},
    "agents": {"defaults": {"workspace": "~/work", "model": {"primary": "openai/gpt-5"}}},
    "plugins": {"load": {"paths": ["/opt/other-plugin"]}, "entries": {"other": {"enabled": True}}},
}


def _write(home: Path, config: object) -> Path:
    path = oc.config_path(home)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config, indent=2))
    return path


def test_provider_entry_points_at_v1_and_never_holds_a_key():
    keyed = oc.provider_entry("http://10.0.0.5:30000/v1/", "m", keyed=True)
    assert keyed["baseUrl"] == "http://10.0.0.5:30000/v1"
    assert keyed["apiKey"] == "${CLAWBRIDGE_API_KEY}"
    assert keyed["api"] == "openai-completions"
    assert keyed["models"][0]["id"] == "m"
    assert oc.provider_entry("http://h:1", "m")["apiKey"] == "clawbridge"


def test_merge_keeps_the_users_settings_and_adds_ours():
    frag = oc.fragment(PROVIDER, Path("/x/ext/clawbridge"))
    merged = oc.merge(USER_CONFIG, frag)
    assert merged["gateway"] == USER_CONFIG["gateway"]
    assert merged["models"]["providers"]["openai"] == USER_CONFIG["models"]["providers"]["openai"]
    assert merged["models"]["providers"]["clawbridge"] == PROVIDER
    assert merged["agents"]["defaults"]["workspace"] == "~/work"
    assert merged["agents"]["defaults"]["model"]["primary"] == "clawbridge/tiny-random"
    assert merged["plugins"]["load"]["paths"] == ["/opt/other-plugin", "/x/ext/clawbridge"]
    assert merged["plugins"]["entries"]["other"] == {"enabled": True}
    assert merged["plugins"]["entries"]["clawbridge"]["enabled"] is True
    assert (
        USER_CONFIG["agents"]["defaults"]["model"]["primary"] == "openai/gpt-5"
    )  # input untouched


def test_merge_is_idempotent_and_replaces_a_stale_provider_entry():
    frag = oc.fragment(PROVIDER, Path("/x"))
    once = oc.merge(USER_CONFIG, frag)
    assert oc.merge(once, frag) == once
    moved = oc.fragment(oc.provider_entry("http://127.0.0.1:31000", "tiny-random"), Path("/x"))
    again = oc.merge(once, moved)
    assert again["models"]["providers"]["clawbridge"]["baseUrl"] == "http://127.0.0.1:31000/v1"
    assert again["plugins"]["load"]["paths"].count("/x") == 1


def test_merge_without_default_leaves_the_primary_model():
    merged = oc.merge(USER_CONFIG, oc.fragment(PROVIDER, None, set_default=False))
    assert merged["agents"]["defaults"]["model"]["primary"] == "openai/gpt-5"
    assert merged["plugins"] == USER_CONFIG["plugins"]


def test_merge_refuses_a_config_whose_shape_it_would_clobber():
    with pytest.raises(oc.OpenClawConfigError, match="plugins"):
        oc.merge({"plugins": ["not", "an", "object"]}, oc.fragment(PROVIDER, Path("/x")))


def test_install_backs_up_then_second_run_changes_nothing(tmp_path: Path):
    path = _write(tmp_path, USER_CONFIG)
    original = path.read_text()
    first = oc.install(tmp_path, PROVIDER, now=datetime(2026, 11, 22, 9, 0, tzinfo=UTC))
    assert first.changed and first.plugin_changed
    assert first.backup == path.with_name("openclaw.json.bak-20261122T090000Z")
    assert first.backup.read_text() == original
    written = json.loads(path.read_text())
    assert written["models"]["providers"]["clawbridge"] == PROVIDER
    assert written["plugins"]["load"]["paths"][-1] == str(first.plugin_dir)
    assert written["gateway"] == USER_CONFIG["gateway"]

    text, mtime = path.read_text(), path.stat().st_mtime_ns
    second = oc.install(tmp_path, PROVIDER, now=datetime(2026, 11, 22, 9, 5, tzinfo=UTC))
    assert not second.changed and second.backup is None and not second.plugin_changed
    assert path.read_text() == text and path.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in path.parent.glob("openclaw.json.bak-*")) == [first.backup.name]


def test_install_into_an_empty_home_creates_a_private_config(tmp_path: Path):
    r = oc.install(tmp_path, PROVIDER)
    assert r.changed and r.backup is None
    assert r.config_path.stat().st_mode & 0o777 == 0o600
    assert (
        json.loads(r.config_path.read_text())["agents"]["defaults"]["model"]["primary"]
        == "clawbridge/tiny-random"
    )


def test_install_gives_a_fresh_home_a_local_gateway_and_keeps_a_chosen_mode(tmp_path: Path):
    # `openclaw gateway run` refuses a config without gateway.mode
    fresh = json.loads(oc.install(tmp_path / "a", PROVIDER).config_path.read_text())
    assert fresh["gateway"] == {"mode": "local", "bind": "loopback"}
    _write(tmp_path / "b", {"gateway": {"mode": "remote", "port": 1}})
    kept = json.loads(oc.install(tmp_path / "b", PROVIDER).config_path.read_text())
    assert kept["gateway"] == {"mode": "remote", "port": 1}
    _write(tmp_path / "c", {"gateway": {"port": 18789}})
    added = json.loads(oc.install(tmp_path / "c", PROVIDER).config_path.read_text())
    assert added["gateway"] == {"port": 18789, "mode": "local"}


def test_install_gives_agent_runs_time_for_a_cpu_unless_a_timeout_is_set(tmp_path: Path):
    # OpenClaw cuts a run at 600 s by default; one CPU request over its prompt took 515-570 s
    fresh = json.loads(oc.install(tmp_path / "a", PROVIDER).config_path.read_text())
    assert fresh["agents"]["defaults"]["timeoutSeconds"] == oc.RUN_TIMEOUT_S == 3600
    _write(tmp_path / "b", {"agents": {"defaults": {"timeoutSeconds": 120}}})
    kept = json.loads(oc.install(tmp_path / "b", PROVIDER).config_path.read_text())
    assert kept["agents"]["defaults"]["timeoutSeconds"] == 120
    _write(tmp_path / "c", USER_CONFIG)
    not_ours = json.loads(
        oc.install(tmp_path / "c", PROVIDER, set_default=False).config_path.read_text()
    )
    assert "timeoutSeconds" not in not_ours["agents"]["defaults"]


def test_install_leaves_a_json5_config_untouched(tmp_path: Path):
    path = oc.config_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text('{\n  // my gateway\n  gateway: { mode: "local" },\n}\n')
    before = path.read_text()
    with pytest.raises(oc.OpenClawConfigError, match="not plain JSON"):
        oc.install(tmp_path, PROVIDER)
    assert path.read_text() == before
    assert not (oc.state_dir(tmp_path) / "extensions").exists()


def test_plugin_files_declare_the_clawbridge_provider_and_entry():
    src = oc.plugin_source()
    assert sorted(p.name for p in src.iterdir() if not p.name.startswith(".")) == sorted(
        oc.PLUGIN_FILES
    )
    package = json.loads((src / "package.json").read_text())
    manifest = json.loads((src / "openclaw.plugin.json").read_text())
    assert package["type"] == "module"
    assert package["openclaw"]["extensions"] == ["./index.js"]
    assert package["openclaw"]["providers"] == [oc.PROVIDER_ID]
    assert manifest["id"] == oc.PLUGIN_ID and manifest["providers"] == [oc.PROVIDER_ID]
    assert manifest["configSchema"]["type"] == "object"
    js = (src / "index.js").read_text()
    assert "export default plugin" in js
    for needle in (
        '"X-Session-Id"',
        '"X-Turn-Type"',
        '"X-Session-Done"',
        "before_prompt_build",
        "session_end",
        "wrapStreamFn",
        "registerProvider",
        '"heartbeat", "cron", "memory"',
    ):
        assert needle in js, needle


def test_cli_install_and_config_against_a_temporary_home(tmp_path: Path):
    _write(tmp_path, USER_CONFIG)
    runner = CliRunner()
    args = [
        "openclaw",
        "install",
        "--model",
        "tiny-random",
        "--url",
        "http://127.0.0.1:30555",
        "--openclaw-home",
        str(tmp_path),
    ]
    first = runner.invoke(app, args, env={"CLAWBRIDGE_API_KEY": ""})
    assert first.exit_code == 0, first.output
    assert "previous file" in first.output and "plug-in installed" in first.output
    second = runner.invoke(app, args, env={"CLAWBRIDGE_API_KEY": ""})
    assert second.exit_code == 0 and "already up to date" in second.output
    cfg = json.loads(oc.config_path(tmp_path).read_text())
    assert cfg["models"]["providers"]["clawbridge"]["baseUrl"] == "http://127.0.0.1:30555/v1"
    assert (oc.state_dir(tmp_path) / "extensions" / "clawbridge" / "index.js").exists()

    printed = runner.invoke(app, ["openclaw", "config", "--model", "m", "--keyed"])
    assert printed.exit_code == 0
    frag = json.loads(printed.output)
    assert frag["models"]["providers"]["clawbridge"]["apiKey"] == "${CLAWBRIDGE_API_KEY}"
    assert "plugins" not in frag


def test_cli_says_what_to_do_when_no_server_answers():
    r = CliRunner().invoke(app, ["openclaw", "config", "--url", "http://127.0.0.1:9"])
    assert r.exit_code == 2
    assert "--model" in r.output and "--url" in r.output and "clawbridge up" in r.output


# --- the plug-in's pure helpers, run by Node when it is here -------------------------------------

NODE_CHECK = """
const m = await import(process.argv[1]);
const out = {
  run: m.runIdOf("run-7:model:3"),
  plain: m.runIdOf("abc"),
  side: ["heartbeat", "cron", "memory"].map((t) => m.turnTypeFor(t)),
  main: ["user", "manual", undefined].map((t) => m.turnTypeFor(t)),
  headers: m.taggedHeaders({"X-Other": "1"}, "s-1", "side"),
  userHeaders: m.taggedHeaders({}, "s-1", "main", "telegram-42"),
  users: [
    {sessionKey: "agent:main:main", senderId: "42", messageProvider: "telegram"},
    {sessionKey: "agent:main:telegram:dm:42", senderId: "42", messageProvider: "telegram"},
    {sessionKey: "agent:main:dm:42"},
    {sessionKey: "agent:main:telegram:group:-100777:topic:5", senderId: "42", messageProvider: "telegram"},
    {sessionKey: "agent:main:whatsapp:dm:+1 555/01"},
    {},
  ].map((ctx) => m.userFor(ctx) ?? null),
};
console.log(JSON.stringify(out));
"""


def test_plugin_helpers_tag_runs_by_trigger(tmp_path: Path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    out = subprocess.run(
        [node, "--input-type=module", "-e", NODE_CHECK, str(oc.plugin_source() / "index.js")],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["run"] == "run-7" and got["plain"] == "abc"
    assert got["side"] == ["side"] * 3 and got["main"] == ["main"] * 3
    assert got["headers"] == {"X-Other": "1", "X-Session-Id": "s-1", "X-Turn-Type": "side"}
    assert got["userHeaders"] == {"X-Session-Id": "s-1", "X-Turn-Type": "main", "X-Session-User": "telegram-42"}
    # the main session names nobody (`default`); a direct chat is its sender's; a group's
    # conversation is the group's, whoever of its members sent the message
    assert got["users"] == [None, "telegram-42", "42", "telegram-group--100777", "whatsapp--1-555-01", None]


# --- the plug-in's register(api) under a stand-in for OpenClaw, against a live clawbridge ---------

NODE_DRIVE = """
const [pluginPath, baseUrl] = process.argv.slice(1);
const plugin = (await import(pluginPath)).default;
const hooks = {}; let provider;
const api = {  // the part of OpenClaw's plug-in API the plug-in uses
  pluginConfig: {}, logger: console,
  config: {models: {providers: {clawbridge: {baseUrl, apiKey: "clawbridge"}}}},
  on: (name, fn) => { hooks[name] = fn; },
  registerProvider: (p) => { provider = p; },
};
plugin.register(api);
// what OpenClaw's openai-completions transport does with the wrapped model: POST with its headers
const underlying = async (model, context, options) => {
  const r = await fetch(`${baseUrl}/chat/completions`, {method: "POST",
    headers: {...model.headers, "content-type": "application/json"},
    body: JSON.stringify({model: "tiny-random", messages: context.messages, max_tokens: 2})});
  return {status: r.status, headers: model.headers};
};
const stream = provider.wrapStreamFn({streamFn: underlying});
const dm = {sessionId: "oc-7", sessionKey: "agent:main:telegram:dm:42", messageProvider: "telegram"};
hooks.before_prompt_build({}, {...dm, runId: "run-user", trigger: "user", senderId: "42"});
hooks.before_prompt_build({}, {...dm, runId: "run-hb", trigger: "heartbeat"});
const out = [];
out.push(await stream({id: "tiny-random", headers: {}}, {messages: [{role: "user", content: "hi"}]},
                      {sessionId: "oc-7", requestId: "run-user:model:1"}));
out.push(await stream({id: "tiny-random", headers: {}}, {messages: [{role: "user", content: "HEARTBEAT"}]},
                      {sessionId: "oc-7", requestId: "run-hb:model:1"}));
out.push(await stream({id: "tiny-random", headers: {}}, {messages: [{role: "user", content: "summarize"}]},
                      {requestId: "run-user:model:2"}));  // a compaction summary: no session
await hooks.session_end({sessionId: "oc-7", messageCount: 2, reason: "new"}, {sessionId: "oc-7"});
console.log(JSON.stringify({provider: provider.id, hooks: Object.keys(hooks).sort(), out}));
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    settings = Settings(
        model="tiny-random",
        port=0,
        data_dir=tmp_path_factory.mktemp("openclaw"),
        train=False,
        default_max_tokens=4,
    )
    server = LiveServer(settings, build_backend(settings)).start()
    yield server
    server.stop()


def test_install_sizes_the_provider_by_the_server_it_points_at(live: LiveServer, tmp_path: Path):
    # the model, its context and the budget a CPU server suggests, from /v1/models
    card = httpx.get(f"{live.url}/v1/models").json()["data"][0]
    assert card["max_model_len"] == 32768 and card["suggested_max_tokens"] == 128
    r = CliRunner().invoke(
        app,
        ["openclaw", "install", "--url", live.url, "--openclaw-home", str(tmp_path)],
        env={"CLAWBRIDGE_API_KEY": ""},
    )
    assert r.exit_code == 0, r.output
    assert "contextWindow 32768, maxTokens 128" in r.output
    [model] = json.loads(oc.config_path(tmp_path).read_text())["models"]["providers"]["clawbridge"][
        "models"
    ]
    assert (model["id"], model["contextWindow"], model["maxTokens"]) == ("tiny-random", 32768, 128)
    flags = CliRunner().invoke(
        app,
        ["openclaw", "config", "--url", live.url, "--context-window", "9000", "--max-tokens", "64"],
        env={"CLAWBRIDGE_API_KEY": ""},
    )
    [model] = json.loads(flags.output)["models"]["providers"]["clawbridge"]["models"]
    assert (model["contextWindow"], model["maxTokens"]) == (9000, 64)


def test_a_compaction_summary_without_a_session_is_a_side_turn(live: LiveServer):
    summary = {
        "model": "tiny-random",
        "max_tokens": 2,
        "messages": [
            {
                "role": "system",
                "content": "You are a context summarization assistant. Summarize the conversation.",
            },
            {"role": "user", "content": "user: hi\nassistant: hello"},
        ],
    }
    for headers in ({}, {"X-Turn-Type": "main"}):  # untagged, or tagged main by an older plug-in
        assert (
            httpx.post(f"{live.url}/v1/chat/completions", json=summary, headers=headers).status_code
            == 200
        )
    store = live.running.store  # type: ignore[union-attr]
    turns = [t for t in iter_export(store) if "summarization assistant" in str(t["messages"][0])]
    assert [t["turn_type"] for t in turns] == ["side", "side"]


def test_plugin_tags_main_and_heartbeat_turns_and_ends_the_session(live: LiveServer):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    r = subprocess.run(
        [
            node,
            "--input-type=module",
            "-e",
            NODE_DRIVE,
            str(oc.plugin_source() / "index.js"),
            f"{live.url}/v1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["provider"] == "clawbridge"
    assert got["hooks"] == ["agent_end", "before_prompt_build", "session_end"]
    assert [o["status"] for o in got["out"]] == [200, 200, 200]
    assert [o["headers"]["X-Turn-Type"] for o in got["out"]] == ["main", "side", "side"]
    assert "X-Session-Id" not in got["out"][2]["headers"]
    assert [o["headers"].get("X-Session-User") for o in got["out"]] == ["telegram-42", "telegram-42", None]
    store = live.running.store  # type: ignore[union-attr]
    main, side = store.session_turns("oc-7")
    assert (main.turn_type, side.turn_type) == ("main", "side") and main.tagged
    assert main.user == side.user == "telegram-42"  # the heartbeat in the chat is the chat's
    session = store.get_session("oc-7")
    assert session is not None and session.source == "header" and session.done
