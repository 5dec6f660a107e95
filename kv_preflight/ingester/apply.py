"""One batch into the index: planned (ingester/bridge.py), sent to the apply script, and carried through
the recovery rules (ingester/recovery.py) until it settles.

Ordering and exactly-once come from the index script's seq check (kv_preflight/index/index.py): a batch
applies only if it is the next seq of its (pod, dp rank). Everything else is recovery: a gap asks the
engine's replay socket for what was missed, a seq that went backwards with a newer timestamp is an engine
restart (clear, then apply), and an older duplicate (another ingester got there first) is skipped.

A gap's replay is asked in a task of its own, never in the loop: the pod is held (its later batches wait, in
arrival order) while every other pod's batches go on, and the loop applies the replayed batches, the one
that found the gap and those that waited, in seq order, once the answer is in (``apply_held``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from kv_preflight.config import Config
from kv_preflight.events import EventBatch
from kv_preflight.index.engine_keys import resolve_engine_keys
from kv_preflight.index.index import ApplyResult, Index, MarkIncomplete
from kv_preflight.index.pod_log import PodLogError
from kv_preflight.ingester.bridge import ChainState, Plan, plan_batch, seed_held, seed_state, unresolved_parents
from kv_preflight.ingester.counters import Counters
from kv_preflight.ingester.recovery import MAX_STEPS, Done, Force, Replay, Reset, ResetIfThenCheck, next_step
from kv_preflight.ingester.replay import fetch_replay
from kv_preflight.ingester.routes import Routes
from kv_preflight.ingester.valkey_retry import ValkeyRetry
from kv_preflight.keys.chain import chain_root

log = logging.getLogger("kvpf.ingester")

# A replay socket that did not answer at all is not asked again for this long: its pod's gaps are flagged
# incomplete at once meanwhile (exact again at the pod's next reset) rather than held for its timeout each.
SILENT_REPLAY_S = 30.0

# The counter of each answer of the apply script (ingester/counters.py).
_ANSWERS = {"applied": "batches_applied", "dup": "duplicates_skipped", "gap": "batches_gap",
            "restart": "batches_restart", "corrupt": "corrupt_batches"}


@dataclass
class _Pending:
    """A batch on its way into the index, and where its recovery stands."""

    seq: int
    batch: EventBatch
    decode_errors: int
    can_replay: bool
    mode: str = "check"
    steps: int = 0  # attempts so far (at most MAX_STEPS)
    placeholders: int = 0  # a replayed batch's skipped events, counted when its turn comes
    stop_at_gap: bool = False  # a gap ends it unapplied ("gap"), neither replayed nor forced (Applier.apply)


@dataclass
class _Held:
    """A pod whose gap is being replayed in the background: the batch that found it, and those that
    arrived since, wait here in arrival order until the replay's answer is in."""

    model: str
    gap: _Pending
    rank: int
    start: int
    replay: str
    fetch: asyncio.Future
    waiting: list[_Pending] = field(default_factory=list)


class Applier:
    def __init__(self, cfg: Config, index: Index, routes: Routes, counters: Counters, valkey: ValkeyRetry):
        self.cfg = cfg
        self.index = index
        self.routes = routes
        self.counters = counters
        self.valkey = valkey
        self.state = ChainState()  # the chain points the last ``plan`` used (its ``chains``)
        self.last_applied: dict[str, float] = {}  # pod -> monotonic time of its last applied batch
        self._silent: dict[str, float] = {}  # replay endpoint that did not answer -> not asked until (monotonic)
        self.held: dict[str, _Held] = {}  # pods whose gap is being replayed (``apply_held`` carries them on)
        # pods being rebuilt from their replay (ingester/resume.py): their live batches wait here, in arrival
        # order, until the rebuild has cleared the pod and applied the replay (``unpark``)
        self.parked: dict[str, list[tuple[str, _Pending]]] = {}
        self.last_batch_ts: dict[str, float] = {}  # pod -> engine timestamp of its newest applied batch
        # a pod's first write waits for a lease listing it (ingester/lease.py ``vouch``): set by the ingester
        self.vouch: Callable[[str], Awaitable[None]] | None = None
        self.vouched: set[str] = set()

    # ---- planning

    def _root(self, model: str) -> int:
        """A model's chain root (a held block that keyed nothing and starts its chain continues from it)."""
        return chain_root(model, self.cfg.hash_seed, self.cfg.hash_algo)

    async def plan(self, pod: str, model: str, seq: int, batch: EventBatch, decode_errors: int = 0, *,
                   chains: ChainState | None = None, mode: str = "check") -> Plan:
        """The batch's mutations; what makes the pod incomplete (orphans, undecodable events) ends them
        as a MarkIncomplete, so the flag is written by the very script that applies the batch. ``chains``: the
        chain points of the batches planned before it and maybe not applied yet (none: it goes alone)."""
        if self.vouch is not None and pod not in self.vouched:
            await self.vouch(pod)
        self.state = chains if chains is not None else ChainState()
        plan = await self._plan_events(pod, model, seq, batch, self.state, mode)
        reasons = []
        if plan.orphans:
            reasons.append(f"{plan.orphans} stored block(s) had an unknown parent")
        if decode_errors:  # a dropped BlockRemoved would leave blocks the engine no longer has
            reasons.append(f"{decode_errors} event(s) at seq {seq} could not be decoded")
        if reasons:
            plan.mutations.append(MarkIncomplete("; ".join(reasons)))
        return plan

    async def _plan_events(self, pod: str, model: str, seq: int, batch: EventBatch, chains: ChainState,
                           mode: str) -> Plan:
        """A parent not in ``chains`` is taken from the pod's state, then Valkey's engine map. Not from the pod's
        state in a reset (the engine restarted: the pod's blocks are the old process's, cleared before this batch
        applies)."""
        pod_state = await self.valkey.call(self.index.pod_state, pod)
        known = pod_state.block_keys if mode != "reset" else None
        missing = unresolved_parents(batch, model, chains, self.cfg.lora_names)
        if missing and known is not None:
            missing = seed_held(chains, missing, known, pod_state.carries, self._root)
        if missing:
            resolved = await self.valkey.call(resolve_engine_keys, self.index.client, [ek for _, ek in missing], pod)
            seed_state(chains, {(m, ek): resolved[ek] for m, ek in missing if ek in resolved})
        try:
            plan = plan_batch(
                batch, pod_id=pod, topic_model=model, state=chains, hash_seed=self.cfg.hash_seed,
                block_size=self.cfg.block_size, entry_field=self.index.entry_field, lora_names=self.cfg.lora_names,
                hash_algo=self.cfg.hash_algo, extra_keys=self.routes.engine_of(pod).extra_keys, known=known,
            )
            return plan
        except Exception as exc:  # a batch no rule anticipated: keep the seq moving, flag the pod
            log.error("%s seq %d: batch could not be planned (%s); applying it empty", pod, seq, exc)
            await self.counters.count("plan_errors")
            return Plan(mutations=[MarkIncomplete(f"batch at seq {seq} could not be applied: {exc}")])

    # ---- one batch, and the batches a gap before it needs

    async def apply(self, pod: str, model: str, seq: int, batch: EventBatch, *, allow_replay: bool = True,
                    mode: str = "check", decode_errors: int = 0, resumed: bool = False,
                    stop_at_gap: bool = False) -> str:
        """Apply one batch; returns its final status. Retries transient Valkey errors until it is back; the
        recovery rules (ingester/recovery.py) decide each next step, at most MAX_STEPS per batch. A gap
        to replay holds the pod ("held": this batch and the pod's next ones wait for ``apply_held``).
        ``stop_at_gap``: a gap answers "gap" and nothing is applied or flagged (a rebuild's whole replay, whose
        gap can only be another writer's reset of the pod under it: ``Resume._apply``)."""
        item = _Pending(seq, batch, decode_errors, allow_replay, mode, stop_at_gap=stop_at_gap)
        parked = self.parked.get(pod)
        if parked is not None and not resumed:  # its rebuild is under way: after it (``resumed``: the replay itself)
            parked.append((model, item))
            return "held"
        held = self.held.get(pod)
        if held is not None:  # behind a gap being replayed: in turn, after it
            held.waiting.append(item)
            return "held"
        return await self._settle(pod, model, item)

    async def _settle(self, pod: str, model: str, item: _Pending) -> str:
        """Carry one batch through the rules until it settles (a loop, not a recursion): its final status."""
        if item.placeholders:
            await self.counters.count("placeholder_events", item.placeholders)
            item.placeholders = 0
        while item.steps < MAX_STEPS:
            item.steps += 1
            outcome = await self._attempt(pod, model, item)
            if outcome is not None:
                return outcome
        await self.failed(pod, item.seq, f"no recovery rule settled the batch in {MAX_STEPS} steps")
        return "error"

    async def _attempt(self, pod: str, model: str, item: _Pending) -> str | None:
        """Send the batch once and carry out the step the rules give: its final status ("held": the pod waits
        for its gap's replay), or None (try it again in ``item.mode``)."""
        seq, batch = item.seq, item.batch
        rank = batch.data_parallel_rank or 0
        try:
            plan = await self.plan(pod, model, seq, batch, item.decode_errors, mode=item.mode)
        except PodLogError as exc:  # (the pod's state, loaded to plan against)
            await self.unreadable(pod, seq, exc)
            return "error"
        try:
            result = await self.valkey.call(
                self.index.apply_batch, pod_id=pod, rank=rank, seq=seq, ts=batch.ts, model=model,
                engine_block_size=plan.engine_block_size, groups=plan.groups, mutations=plan.mutations, mode=item.mode,
                adapters=plan.adapters, carries=plan.carries,
            )
        except ResponseError as exc:  # not transient: the batch cannot be applied; others go on
            await self.failed(pod, seq, f"Valkey refused the batch: {exc}")
            return "error"
        except PodLogError as exc:  # (loaded again to apply it: another writer had moved the pod)
            await self.unreadable(pod, seq, exc)
            return "error"
        except ValueError as exc:  # a batch the pod's state log cannot hold (hostile: past 16 tiers, say)
            await self.failed(pod, seq, f"batch cannot be written: {exc}")
            return "error"
        await self.answered(pod, seq, batch, plan, result)
        replay = self.routes.replay_endpoint(pod, rank)
        step = next_step(result.status, mode=item.mode, seq=seq, last_seq=result.last_seq,
                         can_replay=item.can_replay and replay is not None, has_replay=replay is not None)
        if isinstance(step, Done):
            return step.status
        if isinstance(step, Reset):
            log.warning("%s: seq went back from %d to 0 with a newer timestamp: engine restarted, clearing its "
                        "entries", pod, result.last_seq)
            await self.counters.count("engine_restarts")
            item.mode = "reset"
        elif isinstance(step, ResetIfThenCheck):
            log.warning("%s: seq went back from %d to %d with a newer timestamp: engine restarted, clearing its "
                        "entries", pod, result.last_seq, seq)
            await self.counters.count("engine_restarts")
            try:
                await self.valkey.call(self.index.reset_if_seq, pod, rank, step.last_seq)
            except PodLogError as exc:  # (loaded again to clear it: the restart's answer made this writer forget it)
                await self.unreadable(pod, seq, exc)
                return "error"
            item.mode = "check"
        elif isinstance(step, (Replay, Force)) and item.stop_at_gap:
            return "gap"
        elif isinstance(step, Replay):
            assert replay is not None
            item.can_replay = False
            await self.counters.count("gaps", pod=pod)
            if self._silent.get(replay, 0.0) <= time.monotonic():
                log.info("%s: gap, have seq %d, got %d; replaying from %d in the background", pod, step.start - 1,
                         seq, step.start)
                fetch = asyncio.ensure_future(fetch_replay(replay, step.start, timeout_s=self.cfg.replay_timeout_s,
                                                           source=self.routes.replay_source(replay)))
                self.held[pod] = _Held(model, item, rank, step.start, replay, fetch)
                return "held"
            # it did not answer a moment ago: holding the pod for its timeout again would only delay it
            log.info("%s: gap, have seq %d, got %d; replay socket %s silent lately, not asked", pod, step.start - 1,
                     seq, replay)
            await self._force(pod, self._unreplayed(step.start, seq))
            item.mode = "force"
        elif isinstance(step, Force):
            await self.counters.count("gaps", pod=pod)
            await self._force(pod, step.reason)
            item.mode = "force"
        return None

    @staticmethod
    def _unreplayed(start: int, seq: int) -> str:
        return f"events {start}..{seq - 1} were missed and the engine's replay buffer no longer holds them"

    def fetches(self) -> list[asyncio.Future]:
        """The gap replays being fetched (the loop wakes when one is in)."""
        return [h.fetch for h in self.held.values()]

    async def apply_held(self) -> None:
        """Carry on every held pod whose replay answered: the missed batches (if the answer holds them all;
        else the pod is flagged incomplete and applied past the gap), the batch that found the gap, then
        those that waited, in arrival order. One of them may find a gap again: the rest wait on that one."""
        for pod, held in list(self.held.items()):
            if not held.fetch.done():
                continue
            del self.held[pod]
            queue = [*await self._replayed(pod, held), held.gap, *held.waiting]
            while queue:
                await self._settle(pod, held.model, queue.pop(0))
                again = self.held.get(pod)
                if again is not None:  # a later gap: the rest wait behind it
                    again.waiting.extend(queue)
                    break

    async def _replayed(self, pod: str, held: _Held) -> list[_Pending]:
        """The missed batches the replay answered, to apply before the one that found the gap (earliest
        first); none, with the pod flagged and that batch forced past the gap, if it does not hold them all."""
        seq, start, replay = held.gap.seq, held.start, held.replay
        frames, complete = [], False
        if held.fetch.cancelled():
            pass
        elif held.fetch.exception() is not None:
            log.warning("%s: replay from %s failed (%s)", pod, replay, held.fetch.exception())
        else:
            frames, complete = held.fetch.result()
        if not frames and not complete:  # no answer at all: not asked again for SILENT_REPLAY_S
            self._silent[replay] = time.monotonic() + SILENT_REPLAY_S
            log.warning("%s: replay socket %s did not answer within %.1f s; not asked again for %.0f s", pod, replay,
                        self.cfg.replay_timeout_s, SILENT_REPLAY_S)
        await self.counters.count("replays", pod=pod)
        by_seq = {f.seq: f for f in frames if f.batch is not None and f.seq is not None and start <= f.seq < seq
                  and (f.batch.data_parallel_rank or 0) == held.rank}
        if sorted(by_seq) != list(range(start, seq)):
            await self._force(pod, self._unreplayed(start, seq))
            held.gap.mode = "force"
            return []
        held.gap.mode = "check"
        return [_Pending(s, by_seq[s].batch, len(by_seq[s].errors), can_replay=False,
                         placeholders=by_seq[s].skipped) for s in range(start, seq)]

    async def wait_held(self) -> None:
        """Every gap replay fetched and carried on (for callers outside the loop: start-up, tests)."""
        while self.held:
            await asyncio.wait(self.fetches())
            await self.apply_held()

    def let_go(self, pods: set[str] | None = None) -> None:
        """Drop the held pods (None: all): their engines were let go, or the ingester stops; what waited is
        replayed by whoever ingests them next, from their persisted seq."""
        for pod in list(self.held):
            if pods is None or pod in pods:
                self.held.pop(pod).fetch.cancel()
        for pod in list(self.parked):
            if pods is None or pod in pods:
                del self.parked[pod]

    def waits(self, pod: str) -> bool:
        """Whether a batch of this pod must wait behind a gap's replay or a rebuild (``apply`` queues it)."""
        return pod in self.held or pod in self.parked

    def park(self, pod: str) -> None:
        """Hold the pod's batches from now until ``unpark``: a rebuild clears the pod before it applies the
        replay it fetched, and would clear a batch applied meanwhile with it, while the replay does not have it
        (fetched before it arrived): lost, with the pod marked exact."""
        if pod in self.parked:
            return
        parked = self.parked[pod] = []
        held = self.held.pop(pod, None)
        if held is not None:  # a gap being replayed: the rebuild's replay, from seq 0, covers it; its batches
            # wait for the rebuild instead
            held.fetch.cancel()
            held.gap.can_replay = True  # if the rebuild falls short, its gap is replayed again, not forced
            parked.extend((held.model, item) for item in (held.gap, *held.waiting))

    async def unpark(self, pod: str) -> None:
        """The batches that waited while the pod was rebuilt, in arrival order (those the replay had answer
        "dup"; a gap after the replay is replayed as any gap)."""
        for model, item in self.parked.pop(pod, []):
            held = self.held.get(pod)
            if held is not None:  # one of them found a gap: the rest wait behind its replay
                held.waiting.append(item)
            else:
                await self._settle(pod, model, item)

    # ---- what each answer does

    async def answered(self, pod: str, seq: int, batch: EventBatch, plan: Plan, result: ApplyResult) -> None:
        """Count the script's answer to a batch, and note what an applied or corrupt one did."""
        if result.status == "applied":
            await self._applied(pod, seq, batch, plan, result)
        elif result.status == "corrupt":
            await self._corrupt(pod, seq, result.detail)
        elif result.status in _ANSWERS:
            if result.status == "dup":  # a copy applied it: the index has it, so this ingester's lag counts it too
                self.last_batch_ts[pod] = max(self.last_batch_ts.get(pod, 0.0), batch.ts)
            await self.counters.count(_ANSWERS[result.status], pod=pod)

    async def _applied(self, pod: str, seq: int, batch: EventBatch, plan: Plan, result: ApplyResult) -> None:
        # The incomplete flag is the script's (MarkIncomplete set, AllBlocksCleared and reset cleared).
        if result.foreign_writes:
            await self.counters.count("foreign_writes", result.foreign_writes)
            log.error("%s seq %d: %d write(s) skipped, a key of a foreign type is in the way (%s); pod flagged incomplete",
                      pod, seq, result.foreign_writes, result.detail)
        self.counters.metrics.applied(pod, batch)
        self.last_applied[pod] = time.monotonic()
        self.last_batch_ts[pod] = batch.ts
        await self.counters.count("batches_applied", pod=pod)
        await self.counters.count("blocks_stored", plan.stored_blocks)
        await self.counters.count("blocks_removed", plan.removed_blocks)
        if plan.orphans:
            log.warning("%s seq %d: %d BlockStored event(s) with an unknown parent were not indexed", pod, seq, plan.orphans)
            await self.counters.count("orphan_blocks", plan.orphans, pod=pod)

    async def _force(self, pod: str, reason: str) -> None:
        log.warning("%s: %s; marking the pod incomplete", pod, reason)
        await self.counters.count("gaps_unrecovered", pod=pod)
        await self.valkey.call(self.index.meta.mark_incomplete, pod, reason)

    async def _corrupt(self, pod: str, seq: int, detail: str) -> None:
        """A batch the script refused as corrupt (forged seq, foreign-typed pod key): counted, the pod
        flagged, nothing else changed, so the next real batch applies as usual."""
        log.error("%s seq %d: not applied: %s", pod, seq, detail)
        await self.counters.count("corrupt_batches", pod=pod)
        try:
            await self.valkey.call(self.index.meta.mark_incomplete, pod, f"batch at seq {seq} refused: {detail}"[:300])
        except ResponseError:
            pass  # the pod's own key is unusable: the log line and the counter are what is left

    async def unreadable(self, pod: str, seq: int, exc: PodLogError) -> None:
        """A batch of a pod whose state log does not read: nothing can be planned against a pod whose blocks are
        not known, so the batch is not applied (logged, counted) and the pod is flagged, as its entries are no
        longer what its engine holds; other pods go on. (The decoder's error ended the process, and every process
        that took the pod over after it; found on a reload, it was only logged, the pod left exact.)"""
        await self.failed(pod, seq, f"not applied: {exc}")
        await self._flag(pod, f"batch at seq {seq} not applied: {exc}")

    async def not_reset(self, pod: str, why: str, exc: PodLogError) -> None:
        """A reset (``why``: a rebuild, an engine restart found by a probe) of a pod whose state log does not
        read: its blocks are not known, so its entries cannot be found to clear. They stay, the pod flagged with
        the reason (logged, counted as a batch not applied), and what follows for it fails as its batches do
        (``unreadable``); other pods go on. (PodLogError left the reset and ended the process.)"""
        log.error("%s: %s: not reset, its entries left flagged: %s", pod, why, str(exc)[:300])
        await self.counters.count("apply_errors")
        await self._flag(pod, f"{why}: not reset: {exc}")

    async def _flag(self, pod: str, reason: str) -> None:
        try:
            await self.valkey.call(self.index.meta.mark_incomplete, pod, reason[:300])
        except ResponseError:
            pass  # the pod's own key is unusable: the log line and the counter are what is left

    async def failed(self, pod: str, seq: int, why: str) -> None:
        log.error("%s seq %d: %s", pod, seq, why[:300])
        await self.counters.count("apply_errors")
