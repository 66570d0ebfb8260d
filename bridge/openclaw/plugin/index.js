// clawbridge plug-in for OpenClaw.
//
// clawbridge trains on main turns only and judges each turn by the next message of the same
// conversation, so every model request must say which conversation it belongs to and whether it
// is a main turn. OpenClaw sends neither by default. This plug-in:
//   - remembers each run's trigger (before_prompt_build sees ctx.runId and ctx.trigger), keyed by
//     run id, not session: heartbeats share the main session and cron runs interleave with it;
//   - wraps the clawbridge provider's stream function to add X-Session-Id (the OpenClaw session)
//     and X-Turn-Type (side for heartbeat, cron and memory runs and for requests outside any
//     session, such as compaction summaries; main otherwise);
//   - on session_end, POSTs {baseUrl}/sessions/{id}/done with X-Session-Done: true so the
//     session's last turn is closed at once instead of after clawbridge's idle timeout.

const DEFAULT_SIDE_TRIGGERS = ["heartbeat", "cron", "memory"];
const MAX_REMEMBERED_RUNS = 1000;

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

/** The headers clawbridge reads, merged over the request's own. */
export function taggedHeaders(headers, sessionId, turnType) {
  const out = { ...(headers ?? {}) };
  if (sessionId) out["X-Session-Id"] = String(sessionId);
  out["X-Turn-Type"] = turnType;
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

    const remember = (runId, trigger) => {
      if (!runId) return;
      triggers.set(runId, trigger ?? "user");
      if (triggers.size > MAX_REMEMBERED_RUNS) triggers.delete(triggers.keys().next().value);
    };

    api.on("before_prompt_build", (_event, ctx) => {
      remember(ctx?.runId, ctx?.trigger);
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
          const headers = taggedHeaders(model?.headers, options?.sessionId, turnType);
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
