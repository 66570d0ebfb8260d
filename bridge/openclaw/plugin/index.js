// clawbridge plug-in for OpenClaw.
//
// clawbridge trains on main turns only and judges each turn by the next message of the same
// conversation, so every model request must say which conversation it belongs to and whether it
// is a main turn. OpenClaw sends neither by default. This plug-in:
//   - remembers each run's trigger (before_prompt_build sees ctx.runId and ctx.trigger), keyed by
//     run id, not session: heartbeats share the main session and cron runs interleave with it;
//   - wraps the clawbridge provider's stream function to add X-Session-Id (the OpenClaw session),
//     X-Turn-Type (side for heartbeat, cron and memory runs and for requests outside any
//     session, such as compaction summaries; main otherwise) and X-Session-User (whose
//     conversation it is: a direct chat's sender, or a group's; none for the agent's main
//     session, which is clawbridge's `default` user);
//   - on session_end, POSTs {baseUrl}/sessions/{id}/done with X-Session-Done: true so the
//     session's last turn is closed at once instead of after clawbridge's idle timeout.

const DEFAULT_SIDE_TRIGGERS = ["heartbeat", "cron", "memory"];
const MAX_REMEMBERED_RUNS = 1000;
const MAX_REMEMBERED_SESSIONS = 1000;

/** The run id inside OpenClaw's model request id "<runId>:model:<n>". */
export function runIdOf(requestId) {
  if (typeof requestId !== "string" || requestId === "") return undefined;
  const cut = requestId.lastIndexOf(":model:");
  return cut >= 0 ? requestId.slice(0, cut) : requestId;
}

/** main or side, from the trigger of the run that makes the request. */
export function turnTypeFor(trigger, sideTriggers = DEFAULT_SIDE_TRIGGERS) {
  return trigger && sideTriggers.includes(trigger) ? "side" : "main";
}

/** A name clawbridge takes as a user's: 1 to 64 of A-Z a-z 0-9 . _ @ -, starting with a letter
 * or digit (anything else becomes "-"). */
export function userName(raw) {
  if (raw === undefined || raw === null) return undefined;
  const name = String(raw).replace(/[^A-Za-z0-9._@-]+/g, "-").replace(/^[^A-Za-z0-9]+/, "").slice(0, 64);
  return name || undefined;
}

/**
 * Whose conversation an OpenClaw session is, from its session key ("agent:<agent>:<channel>:
 * group:<id>", "agent:<agent>[:<channel>]:dm:<peer>", "agent:<agent>:main") and the run's sender:
 * a group's or channel's session is the group's, since several people talk in it (each one's
 * message is feedback on the answer before it, whoever asked); a direct chat is its sender's; the
 * agent's main session, where OpenClaw puts every direct chat unless session.dmScope keeps them
 * apart, names nobody (clawbridge's `default` user).
 */
export function userFor(ctx) {
  const parts = typeof ctx?.sessionKey === "string" ? ctx.sessionKey.split(":") : [];
  const at = parts.findIndex((p, i) => i >= 2 && ["group", "channel", "dm", "direct"].includes(p));
  if (at < 0 || !parts[at + 1]) return undefined;
  const channel = ctx?.messageProvider ?? (at > 2 ? parts.slice(2, at).join("-") : undefined);
  const prefix = channel ? `${channel}-` : "";
  if (parts[at] === "group" || parts[at] === "channel") return userName(`${prefix}group-${parts[at + 1]}`);
  return userName(`${prefix}${ctx?.senderId ?? parts[at + 1]}`);
}

/** The headers clawbridge reads, merged over the request's own. */
export function taggedHeaders(headers, sessionId, turnType, user) {
  const out = { ...(headers ?? {}) };
  if (sessionId) out["X-Session-Id"] = String(sessionId);
  out["X-Turn-Type"] = turnType;
  if (sessionId && user) out["X-Session-User"] = user;
  return out;
}

function providerConfig(config, providerId) {
  return config?.models?.providers?.[providerId] ?? {};
}

function resolveKey(apiKey, env) {
  if (typeof apiKey !== "string") return undefined;
  const m = /^\$\{([A-Z0-9_]+)\}$/.exec(apiKey.trim());
  return m ? env[m[1]] : apiKey;
}

const plugin = {
  id: "clawbridge",
  name: "clawbridge",
  description: "Tags model requests for clawbridge: session id, turn type, session done.",
  register(api) {
    const cfg = api.pluginConfig ?? {};
    const providerId = typeof cfg.provider === "string" ? cfg.provider : "clawbridge";
    const sideTriggers = Array.isArray(cfg.sideTriggers) ? cfg.sideTriggers : DEFAULT_SIDE_TRIGGERS;
    const triggers = new Map(); // runId -> trigger
    const sessionUsers = new Map(); // sessionId -> the user its conversation is for (userFor)
    const withUsers = cfg.users !== false;

    const remember = (runId, trigger) => {
      if (!runId) return;
      triggers.set(runId, trigger ?? "user");
      if (triggers.size > MAX_REMEMBERED_RUNS) triggers.delete(triggers.keys().next().value);
    };

    api.on("before_prompt_build", (_event, ctx) => {
      remember(ctx?.runId, ctx?.trigger);
      if (withUsers && ctx?.sessionId && typeof ctx?.sessionKey === "string") {
        sessionUsers.set(ctx.sessionId, userFor(ctx));
        if (sessionUsers.size > MAX_REMEMBERED_SESSIONS) sessionUsers.delete(sessionUsers.keys().next().value);
      }
    });
    api.on("agent_end", (_event, ctx) => {
      if (ctx?.runId) triggers.delete(ctx.runId);
    });

    api.registerProvider({
      id: providerId,
      label: "clawbridge",
      docsPath: "https://github.com/clawbridge/clawbridge/blob/main/docs/openclaw.md",
      auth: [],
      wrapStreamFn: (ctx) => {
        const underlying = ctx.streamFn;
        if (!underlying) return undefined;
        return (model, context, options) => {
          const trigger = triggers.get(runIdOf(options?.requestId));
          const turnType = options?.sessionId ? turnTypeFor(trigger, sideTriggers) : "side";
          const user = options?.sessionId ? sessionUsers.get(options.sessionId) : undefined;
          const headers = taggedHeaders(model?.headers, options?.sessionId, turnType, user);
          return underlying({ ...model, headers }, context, options);
        };
      },
    });

    if (cfg.sessionDone !== false) {
      api.on("session_end", async (event) => {
        const sessionId = event?.sessionId;
        const provider = providerConfig(api.config, providerId);
        if (!sessionId || typeof provider.baseUrl !== "string") return;
        const url = `${provider.baseUrl.replace(/\/+$/, "")}/sessions/${encodeURIComponent(sessionId)}/done`;
        const headers = { "X-Session-Id": sessionId, "X-Session-Done": "true" };
        const user = sessionUsers.get(sessionId);
        if (user) headers["X-Session-User"] = user;
        sessionUsers.delete(sessionId);
        const key = resolveKey(provider.apiKey, process.env);
        if (key) headers.Authorization = `Bearer ${key}`;
        try {
          const res = await fetch(url, { method: "POST", headers, signal: AbortSignal.timeout(5000) });
          if (!res.ok) api.logger?.warn?.(`clawbridge: session ${sessionId} done -> HTTP ${res.status}`);
        } catch (err) {
          // clawbridge closes idle sessions itself; a missed notice only delays the last turn.
          api.logger?.warn?.(`clawbridge: could not mark session ${sessionId} done: ${err}`);
        }
      });
    }
  },
};

export default plugin;
