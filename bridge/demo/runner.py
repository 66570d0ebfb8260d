"""`clawbridge demo`: watch the served model learn a user's hidden preference.

    start the stack (local backend, store, proxy, learner) on a free loopback port
    evaluate policy@v0 on held-out prompts                     (through the HTTP API, X-Train: false)
    ask v0 for the preference: teachability, and the price     (the prompted twin on the general probe)
    repeat `rounds` times:
        the simulated user asks B training prompts (openai client, one session each) and replies
        to each answer — thanks when it meets the preference, a correction when not
        clawbridge judges the replies, builds samples, trains one step and publishes v+1
        evaluate the new version on the held-out prompts
    report before/after with a 95 % interval of the paired difference, the price and the last
    version against the twin, a PNG, a JSON summary (with the seconds each part took)

The rounds themselves are `rounds.play`, shared with the tools demo; this module is what a
round and a measurement mean here. Nothing here trains directly: the demo is a user of the public
API, like any agent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clawbridge.config import Settings
from clawbridge.demo import recipe, report, teachability
from clawbridge.demo.report import Series, change, difference, gate_counts
from clawbridge.demo.results import DemoResult, VersionEval
from clawbridge.demo.rounds import NothingToTrain, Progress, Settle, play
from clawbridge.demo.scenario import Scenario, Verdict, paired_interval
from clawbridge.demo.teachability import Price, Teachability
from clawbridge.learning.collector import judge_kinds
from clawbridge.learning.gate import Gate, GateProbe, question_seed
from clawbridge.learning.probes import rate
from clawbridge.protocol import NamesItsDtype
from clawbridge.store import History

if TYPE_CHECKING:
    from clawbridge.learning.learner import Learner
    from clawbridge.server import Running
    from openai import AsyncOpenAI


EXTRA_CONVERSATIONS = 3  # a round plays at most this many batches more before it says nothing trains


def demo_settings(scenario: Scenario, data_dir: Path, **overrides: Any) -> Settings:
    """The preference demo's settings for a scenario (`clawbridge.demo.recipe.DEMO_RECIPE`)."""
    return recipe.demo_settings(scenario.recipe, data_dir, **overrides)


def gate_probes(scenario: Scenario) -> list[GateProbe]:
    """The demo's own gate probes: the scenario's truly-satisfied check on its validation split
    (prompts never trained on, and not the held-out ones the figures are measured on), each asked
    `validation_samples` times of every version. The preference is what they measure (`measures_preference`): a
    candidate that keeps it worse than the serving version, by more than the gate's margin on
    average, is held back."""
    def scorer(prompt: str) -> Any:
        return lambda text, finish: 1.0 if scenario.rate(prompt, text, finish).truly else 0.0

    n = scenario.recipe.validation_samples
    return [GateProbe("validation", tuple(scenario.messages(p)), scorer(p), n, measures_preference=True) for p in scenario.gate_prompts]


class SimulatedUser:
    """Talks to clawbridge through the OpenAI API and reacts to each answer: thanks when it meets
    the hidden preference AND answers the question, a correction or an objection otherwise."""

    def __init__(self, client: AsyncOpenAI, model: str, scenario: Scenario) -> None:
        self.client, self.model, self.scenario = client, model, scenario
        self.sem = asyncio.Semaphore(scenario.recipe.concurrency)
        self.conversations = 0
        self.satisfied = 0
        self.seconds: dict[str, float] = {}  # wall seconds per kind of measurement

    async def converse(self, prompt: str, i: int) -> bool:
        """One conversation: the question, the answer, the user's reply (which is the turn's
        next state, so the judge can read it), and the session closes."""
        r, sc = self.scenario.recipe, self.scenario
        sid = f"demo-{uuid.uuid4().hex[:12]}"
        head = {"X-Session-Id": sid, "X-Turn-Type": "main"}
        async with self.sem:
            first = await self.client.chat.completions.create(
                model=self.model, messages=sc.messages(prompt),  # type: ignore[arg-type]
                max_tokens=r.max_tokens, temperature=r.temperature, extra_headers=head,
            )
            choice = first.choices[0]
            answer = choice.message.content or ""
            v = sc.rate(prompt, answer, choice.finish_reason)
            history = [*sc.messages(prompt), {"role": "assistant", "content": answer},
                       {"role": "user", "content": sc.reply(v.preferred, i, answered=v.answered, prompt=prompt)}]
            # The reply is the next state of the first turn. Its own answer is not needed: one
            # token, and the session is closed so that turn waits for nothing.
            await self.client.chat.completions.create(
                model=self.model, messages=history,  # type: ignore[arg-type]
                max_tokens=1, temperature=r.temperature,
                extra_headers={**head, "X-Session-Done": "true"},
            )
        self.conversations += 1
        self.satisfied += v.truly
        return v.truly

    async def _answers(self, prompt: str, messages: list[dict[str, str]], n: int, max_tokens: int,
                       seed: int | None = None, *, served: bool = False) -> list[tuple[str, str | None]]:
        """`n` answers, never trained on: the weights alone, or `served` as the user is (with the
        instruction of the preferences applied now)."""
        r = self.scenario.recipe
        head = {"X-Session-Id": f"eval-{uuid.uuid4().hex[:12]}", "X-Train": "false", "X-Session-Done": "true"}
        async with self.sem:
            resp = await self.client.chat.completions.create(
                model=self.model, messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens, temperature=r.temperature, n=n, seed=seed,
                extra_headers=head if served else {**head, "X-Instructions": "off"},
            )
        return [(c.message.content or "", c.finish_reason) for c in resp.choices]

    async def ask(self, prompt: str, messages: list[dict[str, str]], n: int) -> list[tuple[str, str | None]]:
        """`n` answers to `messages`, seeded by `prompt` as every evaluation is (`teachability.Ask`)."""
        return await self._answers(prompt, messages, n, self.scenario.recipe.max_tokens, eval_seed(prompt))

    def took(self, part: str, since: float) -> None:
        """Add the seconds since `since` to `part` (the --json's seconds_by_part)."""
        self.seconds[part] = self.seconds.get(part, 0.0) + time.monotonic() - since

    async def evaluate(self, version: int, instruction: str | None = None) -> tuple[VersionEval, list[dict[str, Any]]]:
        """Held-out rates of the weights alone: `eval_samples` answers per prompt, never trained
        on; where an `instruction` is served (instant preferences), truly satisfied as served too.
        Every version answers a prompt with the same seed (common random numbers): the engines
        draw by inverse CDF, so two versions that agree answer alike and a paired difference is
        the versions', not the dice's."""
        r, sc = self.scenario.recipe, self.scenario
        t0 = time.monotonic()
        served: tuple[float, ...] = ()
        if instruction is not None:
            async def as_served(prompt: str) -> float:
                answers = await self._answers(prompt, sc.messages(prompt), r.eval_samples, r.max_tokens,
                                              eval_seed(prompt), served=True)
                return rate([sc.rate(prompt, text, finish).truly for text, finish in answers])

            served = tuple(await asyncio.gather(*(as_served(p) for p in sc.heldout_prompts)))

        async def one(prompt: str) -> tuple[list[Verdict], dict[str, Any]]:
            answers = await self._answers(prompt, sc.messages(prompt), r.eval_samples, r.max_tokens, eval_seed(prompt))
            verdicts = [sc.rate(prompt, text, finish) for text, finish in answers]
            v = verdicts[0]
            return verdicts, {"prompt": prompt, "answer": answers[0][0], "preferred": v.preferred,
                              "answered": v.answered, "satisfied": v.truly}

        rated = await asyncio.gather(*(one(p) for p in sc.heldout_prompts))
        self.took("held-out", t0)

        def per_prompt(field_: str) -> tuple[float, ...]:
            return tuple(rate([getattr(v, field_) for v in vs]) for vs, _ in rated)

        pref, topic, truly = per_prompt("preferred"), per_prompt("answered"), per_prompt("truly")
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        ev = VersionEval(version, mean(pref), pref, len(pref) * r.eval_samples, time.monotonic() - t0,
                         on_topic=mean(topic), truly=mean(truly), truly_per_prompt=truly,
                         on_topic_per_prompt=topic, conversations=self.conversations, instruction=instruction,
                         served_truly=mean(served) if served else None)
        return ev, [ex for _, ex in rated]


def eval_seed(prompt: str) -> int:
    """The evaluation seed of a prompt: the same for every version (and every run), and the seed
    the gate asks the same question with under seed 0 (`gate.question_seed`)."""
    seed = question_seed(0, prompt)
    assert seed is not None
    return seed


def _client(base_url: str) -> AsyncOpenAI:
    """The simulated user's client. uvicorn closes a keep-alive connection after 5 s idle (the
    demo idles longer while a step trains): expire pooled connections sooner on this side, and
    retry a request that still meets a closed one, so a wait never crashes the demo."""
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http = DefaultAsyncHttpxClient(timeout=1800, limits=httpx2.Limits(keepalive_expiry=2.0))
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="clawbridge", timeout=1800, max_retries=3, http_client=http)


Note = Callable[[str], None]  # a line for the user, shown as soon as it is known


class PreferenceRounds:
    """The preference demo's side of the rounds (`rounds.Player`): a round is `batch_size`
    conversations; a version is measured when it serves new weights, and at the end. Before
    the first round, v0 is also asked for the preference: teachability and the price."""

    def __init__(self, scenario: Scenario, running: Running, learner: Learner, note: Note | None = None) -> None:
        self.scenario, self.running, self.learner = scenario, running, learner
        self._gate: Gate | None = None
        self.client = _client(running.base_url)
        self.user = SimulatedUser(self.client, running.proxy.model_name, scenario)
        self.note = note or (lambda line: None)
        self.asked = 0
        self.extra = 0  # conversations played this round beyond its batch
        self.shown: dict[int, list[dict[str, Any]]] = {}  # each measured version's examples
        self.teachability: Teachability | None = None
        self.price: Price | None = None

    async def ask_for_it(self, v0: VersionEval) -> None:
        """v0 asked for the preference (the standing preferences the trainer will derive): its
        truly-satisfied rate on the held-out prompts (teachability) and its general-probe rate,
        paired with v0's plain answers by question and seed (the price). Said at once."""
        sc, settings = self.scenario, self.running.settings
        asked = teachability.instruction(sc)
        self.teachability = await teachability.asked_heldout(sc, self.user.ask, asked, sc.recipe.teach_samples, v0.truly)
        self.user.seconds["teachability"] = self.teachability.seconds
        self.note(self.teachability.verdict())
        self.price = Price(v0.probe_per_prompt, await self.probe(0, asked), asked)
        twin_gate = settings.gating.gate == "on" and settings.gating.gate_reference == "twin"
        self.note(self.price.line(settings.gating.gate_max_price if twin_gate else None))

    async def gate(self) -> Gate | None:
        """What measures the general probe: the learner's gate, so the demo's figures are the
        gate's own (the same questions, seeds and answers, one price) and nothing is asked twice;
        a gate built only to measure where the recipe turns gating off. None: no general probe
        (gate_probes 0)."""
        if self._gate is None:
            for _ in range(200):  # the learner binds its parts as the stack starts serving
                if self.learner.trainer is not None:
                    break
                await asyncio.sleep(0.05)
            trainer = self.learner.trainer
            self._gate = trainer.promotion.gate if trainer is not None else None
            if self._gate is None:
                from clawbridge.server import build_gate

                settings, running = self.running.settings, self.running
                self._gate = build_gate(settings.gating.model_copy(update={"gate": "on"}), running.backend, running.renderer,
                                        seed=settings.seed)
        return self._gate

    async def probe(self, version: int, asked: str | None = None) -> tuple[float, ...]:
        """`version`'s score per general probe question as the gate measures it: v0 and the twin
        (`asked`) with the gate's reference answers per question, a candidate with its own."""
        gate = await self.gate()
        if gate is None:
            return ()
        t0 = time.monotonic()
        samples = gate.reference_samples if version == 0 else gate.samples
        out = tuple(await gate.general_scores(version, asked, samples))
        self.user.took("twin probe" if asked else "probe", t0)
        return out

    async def with_probe(self, ev: VersionEval) -> VersionEval:
        probed = await self.probe(ev.version)
        return replace(ev, probe=sum(probed) / len(probed) if probed else None, probe_per_prompt=probed)

    def round_label(self, rnd: int, rounds: int) -> str:
        return f"round {rnd + 1}/{rounds}: conversations"

    async def play_round(self, rnd: int) -> None:
        order, n = self.scenario.training_prompts, self.running.settings.training.batch_size
        batch = [order[(self.asked + j) % len(order)] for j in range(n)]
        await asyncio.gather(*(self.user.converse(p, self.asked + j) for j, p in enumerate(batch)))
        self.asked += len(batch)
        self.extra = 0

    async def settle(self, *, stepped: bool) -> Settle:
        if stepped:
            return "done"
        waiting, unsettled = await self._pending()
        r = self.running.settings.training
        if unsettled or waiting >= r.batch_size:
            return "wait"
        # a reply the judge found neutral, or a correction with nothing to train, gave no sample:
        # the user talks a bit more, but not for ever
        if self.extra >= EXTRA_CONVERSATIONS * r.batch_size:
            raise NothingToTrain(
                f"{r.batch_size + self.extra} conversations this round gave {waiting} trainable samples of the "
                f"{r.batch_size} a step needs: the answers were corrected, and a correction trains only its "
                f"rewrite when w_negative is 0 (the recipe's default), and no teacher draw answered the question "
                f"well enough to be one. The teachability line says how often the model meets the preference "
                f"when asked; a scenario whose corrections should push answers down sets w_negative: 1 in its recipe."
            )
        return "more"

    async def more(self) -> None:
        """As many more conversations as the batch lacks, together (one at a time, each waited
        for and judged before the next, cost a round up to half a minute)."""
        waiting, _ = await self._pending()
        order, n = self.scenario.training_prompts, max(1, self.running.settings.training.batch_size - waiting)
        await asyncio.gather(*(self.user.converse(order[(self.asked + j) % len(order)], self.asked + j)
                               for j in range(n)))
        self.asked += n
        self.extra += n

    async def _pending(self) -> tuple[int, int]:
        """(judged samples waiting for the trainer, turns still on their way to a sample)."""
        store = self.running.store
        st = await store.run(store.stats)
        kinds = judge_kinds(self.running.settings.training.method)
        awaiting = len(await store.run(store.turns_awaiting_judgment, kinds, 1000))
        return st.samples.get("judged", 0), st.samples.get("pending", 0) + awaiting

    def served_instruction(self) -> str | None:
        """What the user is served on top of the weights now (the applied preferences)."""
        return self.running.proxy.standing.served

    def wants_measure(self, served: int, previous: VersionEval, *, held_back: bool, last: bool) -> bool:
        """A new version serves, or what is served on top of it changed (a preference applied at
        once, or retired), or the run ends."""
        return (served != previous.version and not held_back) or last or self.served_instruction() != previous.instruction

    async def measure(self, version: int, previous: VersionEval | None, *,
                      last: bool) -> tuple[VersionEval, list[dict[str, Any]]]:
        instruction = self.served_instruction()
        if previous is None:
            ev, ex = await self.user.evaluate(version, instruction)
            ev = await self.with_probe(ev)
            await self.ask_for_it(ev)
        else:
            store = self.running.store
            history = await store.run(store.history)
            copied = reusable(previous, version, history, conversations=self.user.conversations)
            if copied is not None and instruction == previous.instruction:
                ev, ex = copied, self.shown[previous.version]
            else:
                ev, ex = await self.user.evaluate(version, instruction)
            if last and ev.probe is None:
                ev = await self.with_probe(ev)
        self.shown[ev.version] = ex
        return ev, ex

    def headline(self, ev: VersionEval) -> str:
        served = "" if ev.instruction is None else f"; as served, with the instruction {ev.served:.0%}"
        return f"policy@v{ev.version}: truly satisfied {ev.truly:.0%} (the weights alone){served}"

    async def aclose(self) -> None:
        await self.client.close()


async def run_demo(
    scenario: Scenario,
    settings: Settings,
    *,
    progress: Progress | None = None,
    plot_path: Path | None = None,
    # a safety net, not a budget: a round's step and gate (100 probe questions of the candidate,
    # and of v0 and the twin the first time) can take many minutes on a busy 2-core machine
    step_timeout_s: float = 1800.0,
    note: Note | None = None,
) -> DemoResult:
    from clawbridge.learning.learner import Learner

    t0 = time.monotonic()
    learner = Learner(settings, poll_s=0.2, probes=gate_probes(scenario))
    players: list[PreferenceRounds] = []  # made once the stack runs (it needs its address); read after

    def player_for(running: Running) -> PreferenceRounds:
        players.append(PreferenceRounds(scenario, running, learner, note))
        return players[-1]

    played = await play(settings, learner, player_for, rounds=scenario.recipe.rounds, progress=progress,
                        step_timeout_s=step_timeout_s)
    player = players[0]
    user = player.user
    before, after = played.first, played.last
    delta, lo, hi = paired_interval(before.per_prompt, after.per_prompt)
    _, tlo, thi = paired_interval(before.truly_per_prompt, after.truly_per_prompt)
    shown = [
        {"prompt": b["prompt"], "before": b["answer"], "after": a["answer"],
         "after_preferred": a["preferred"], "after_answered": a["answered"]}
        for b, a in played.example_pairs(5)
    ]
    result = DemoResult(
        scenario=scenario.name, model=played.model, method=settings.training.method, before=before.rate,
        after=after.rate, delta=delta, interval=(lo, hi), steps=played.steps, versions=played.versions,
        seconds=time.monotonic() - t0, train_conversations=user.conversations,
        train_satisfied=user.satisfied, heldout_prompts=len(scenario.heldout_prompts),
        eval_samples=scenario.recipe.eval_samples, truly_interval=(tlo, thi), gate=played.gate, examples=shown,
        teachability=player.teachability, price=player.price, parts={**played.seconds, **user.seconds},
        dtype=player.running.backend.dtype if isinstance(player.running.backend, NamesItsDtype) else "fp32",
    )
    if plot_path is not None:
        result.plot = str(save_plot(result, plot_path))
    return result


def reusable(prev: VersionEval, version: int, history: History, *,
             conversations: int) -> VersionEval | None:
    """`prev`'s figures as `version`'s when `version` serves `prev`'s weights (`prev` itself, the
    gate having held every candidate since back, or a restored copy of them): the same weights give
    the same answers to the same seeds, and in bf16 a second asking would only add the prefix
    cache's rounding (docs/engine.md); None: measure `version` (pure). The general probe, where
    `prev` lacks it and the last version needs it, is added by the caller."""
    if not history.same_weights(version, prev.version):
        return None
    return replace(prev, version=version, seconds=0.0, conversations=conversations)


def save_plot(result: DemoResult, path: Path) -> Path:
    """Per served version: truly satisfied, the preference rate, the on-topic rate, the general
    probe's on-topic rate where measured (the gate's figures for the candidates it judged too)."""
    vs = result.versions
    probed = [(v.version, v.probe) for v in vs if v.probe is not None]
    gate_probe = [(g["version"], g["figures"]["probe_candidate"]) for g in result.gate
                  if "probe_candidate" in g.get("figures", {})]
    series = [
        Series("truly satisfied (preference AND answered)", [(v.version, v.truly) for v in vs],
               {"marker": "o", "color": "#1f6feb", "lw": 2}),
        Series("truly satisfied as served (with the instruction)", [(v.version, v.served) for v in vs],
               {"marker": "^", "color": "#8250df", "ls": "--"}),
        Series("preference met", [(v.version, v.rate) for v in vs], {"marker": ".", "color": "#8b949e", "ls": "--"}),
        Series("answers the question", [(v.version, v.on_topic) for v in vs],
               {"marker": ".", "color": "#2da44e", "ls": ":"}),
        Series("general probe: answers the question", sorted(probed + gate_probe),
               {"marker": "s", "ls": "", "color": "#bf8700"}),
    ]
    if result.price is not None:  # what the last version is held to: the base model asked for the preference
        ends = [vs[0].version, vs[-1].version]
        series.append(Series(f"general probe, the base model asked for it (price {result.price.points:.0f} pts)",
                             [(x, result.price.probe_asked) for x in ends], {"color": "#bf8700", "ls": "-.", "lw": 1}))
    lo, hi = (100 * x for x in result.truly_interval)
    title = (f"{result.scenario}: truly satisfied {100 * result.first.truly:.0f}% → {100 * result.last.truly:.0f}% "
             f"(Δ 95% CI [{lo:+.0f}, {hi:+.0f}] pts)")
    return report.save_plot(path, title, series, result.gate)


def _asked_rows(result: DemoResult) -> list[tuple[str, str]]:
    """The table's rows on the base model asked for the preference: teachability, the price, and
    the last version against the prompted twin (the goal: no more than 5 points below it)."""
    rows: list[tuple[str, str]] = []
    t, p, last = result.teachability, result.price, result.last
    if t is not None:
        rows.append(("asked for it, v0 truly satisfied (teachability)",
                     f"{t.asked:.0%} (unasked {t.plain:.0%}){': little to learn from' if t.little else ''}"))
    if p is not None:
        lo_hi = result.price_interval
        interval = "" if lo_hi is None else f" [{100 * lo_hi[0]:+.0f}, {100 * lo_hi[1]:+.0f}]"
        rows.append(("the price: general probe, plain → asked", f"{change(p.probe_plain, p.probe_asked)} "
                     f"({p.points:.0f} pts{interval})"))
        if last.probe is not None:
            rows.append(("general probe: last version vs the twin",
                         f"{last.probe:.0%} vs {p.probe_asked:.0%} ({100 * (last.probe - p.probe_asked):+.0f} pts)"))
    return rows


def served_curve(result: DemoResult) -> str:
    """Truly satisfied as the user was served at each measurement, by conversations: `0: 0% · 11:
    32% · ...` (the applied preferences' instruction on top of the weights, until they carry it)."""
    return " · ".join(f"{v.conversations}: {v.served:.0%}" for v in result.versions)


def result_table(result: DemoResult) -> list[tuple[str, str]]:
    b, a = result.first, result.last
    c80 = result.conversations_to_80
    instructed = any(v.instruction is not None for v in result.versions)
    served = (("as served, by conversations (instant preferences)", served_curve(result)) if instructed
              else ("as served", "the weights alone"))
    return [
        ("truly satisfied (preference met AND answered)", f"{change(b.truly, a.truly)} (policy@v{a.version})"),
        ("difference (95% interval)", difference(b.truly, a.truly, result.truly_interval)),
        served,
        ("preference met", change(b.rate, a.rate)),
        ("answers the question (held-out)", change(b.on_topic, a.on_topic)),
        ("general probe: answers the question", change(b.probe, a.probe, result.probe_interval)),
        *_asked_rows(result),
        ("gate: accepted / held back", gate_counts(result.gate)),
        ("conversations until 80% truly satisfied", "not reached" if c80 is None else str(c80)),
        ("training steps / conversations", f"{result.steps} / {result.train_conversations}"),
        ("wall time", f"{result.seconds:.0f} s"),
    ]


__all__ = ["DemoResult", "PreferenceRounds", "SimulatedUser", "VersionEval", "demo_settings", "run_demo",
           "save_plot"]
