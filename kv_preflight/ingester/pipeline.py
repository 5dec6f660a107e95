"""The batch pipeline: messages in arrival order, accepted and planned one by one, applied in pipelined
round trips (at most ``PIPELINE_BATCHES`` batches per trip, two trips in flight).

The seq check still runs per batch inside Valkey, so order and exactly-once hold; a batch not applied at
once (gap, restart, or one behind such a batch) goes through ``Applier.apply``, in order, which recovers; a
pod waiting for a gap's replay has its batches queued behind it there, unplanned.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

from redis.exceptions import ResponseError

from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.index import VALKEY_ERRORS
from kv_preflight.index.write_side import WriteSide
from kv_preflight.ingester.accept import Accepted, FrameAcceptor
from kv_preflight.ingester.apply import Applier
from kv_preflight.ingester.bridge import ChainState, Plan
from kv_preflight.ingester.sources import Source
from kv_preflight.ingester.valkey_retry import ValkeyRetry, transient

# Batches sent to Valkey in one round trip when several messages are already queued.
PIPELINE_BATCHES = 64


class Pipeline:
    def __init__(self, acceptor: FrameAcceptor, applier: Applier, index: WriteSide, valkey: ValkeyRetry):
        self.acceptor = acceptor
        self.applier = applier
        self.index = index
        self.valkey = valkey

    async def handle_messages(self, messages: list[tuple[Source, list[bytes]]]) -> None:
        accepted = []
        for src, frames in messages:
            item = await self.acceptor.accept(src, frames)
            if item is None:
                continue
            if self.applier.waits(item[0]):  # its pod waits for a gap's replay or a rebuild: in turn, behind it
                pod, model, seq, batch, errors = item
                await self.applier.apply(pod, model, seq, batch, decode_errors=errors)
            else:
                accepted.append(item)
        # Two runs in flight: while Valkey applies one, the next is planned and written. A parent planned in
        # either is in no pod's state nor Valkey yet (or in a state loaded again meanwhile): their chain points.
        inflight = None
        chains = ChainState()
        for run in _runs(accepted):
            if isinstance(run, tuple):  # alone, once every batch before it applied (``_Flight``)
                if inflight is not None:
                    await self._finish_run(*inflight)
                    inflight = None
                pod, model, seq, batch, errors = run
                await self.applier.apply(pod, model, seq, batch, decode_errors=errors)
                chains = ChainState()  # nothing in flight: every pod's state and Valkey are as applied
                continue
            try:
                plans = [await self.applier.plan(pod, model, seq, batch, errors, chains=chains)
                         for pod, model, seq, batch, errors in run]
                args = [dict(pod_id=pod, rank=batch.data_parallel_rank or 0, seq=seq, ts=batch.ts, model=model,
                             engine_block_size=plan.engine_block_size, groups=plan.groups, mutations=plan.mutations,
                             adapters=plan.adapters, carries=plan.carries)
                        for (pod, model, seq, batch, _), plan in zip(run, plans)]
                sent = await self.valkey.call(self.index.send_batches, args)
            except ValueError:  # a batch of the run its pod's state log cannot hold, or a pod whose log does not
                # read (PodLogError): each alone, those fail
                if inflight is not None:
                    await self._finish_run(*inflight)
                    inflight = None
                for pod, model, seq, batch, errors in run:
                    await self.applier.apply(pod, model, seq, batch, decode_errors=errors)
                continue
            if inflight is not None:
                await self._finish_run(*inflight)
            inflight = (run, plans, args, sent)
        if inflight is not None:
            await self._finish_run(*inflight)

    async def _finish_run(self, run: list[Accepted], plans: list[Plan], args: list[dict], sent: "asyncio.Future") -> None:
        try:
            try:
                results = await sent
            except VALKEY_ERRORS as exc:
                if not transient(exc):
                    raise
                self.valkey.note_failure()  # the run was sent outside ``call``: its failure counts all the same
                # Lost with the connection: send the run again (what did apply answers "dup").
                results = await self.valkey.call(self.index.apply_batches, args)
        except (ResponseError, ValueError):
            # One batch of the run was refused for good, or a pod loaded again to plan it anew (another writer moved
            # it) has a log that does not read (PodLogError): each goes alone, so only that one fails.
            for pod, model, seq, batch, errors in run:
                await self.applier.apply(pod, model, seq, batch, decode_errors=errors)
            return
        for (pod, model, seq, batch, errors), plan, result in zip(run, plans, results):
            if result.status in ("applied", "dup", "corrupt"):  # corrupt: refused for good, sending it again would not change that
                await self.applier.answered(pod, seq, batch, plan, result)
            else:  # gap or restart, or behind one: the one-batch path re-checks (and counts), recovers
                await self.applier.apply(pod, model, seq, batch, decode_errors=errors)


class _Flight:
    """What the batches of a call that may not have applied yet let go of, per pod: engine keys removed, and
    those stored since the pod was cleared. A batch storing a child of one goes alone once they applied, so it is
    planned against the pod's state and Valkey as they are then, as one applied by itself would be: the chain
    points of a run would key it, where the pod's state after its batches no longer holds the parent."""

    def __init__(self) -> None:
        self.dropped: dict[str, set[int]] = {}
        self.since_clear: dict[str, set[int]] = {}

    def waits(self, pod: str, batch: EventBatch) -> bool:
        """Note the batch's events; True (its own are then of no use) if one stores a child of a block let go."""
        dropped = self.dropped.setdefault(pod, set())
        drop = dropped.update
        since = self.since_clear.get(pod)
        for ev in batch.events:
            kind = type(ev)  # (once per event of every batch: one type test, not isinstance's chain)
            if kind is BlockRemoved:
                drop(ev.block_hashes)
                if since is not None:
                    since.difference_update(ev.block_hashes)
            elif kind is BlockStored:
                p = ev.parent_block_hash
                if p is not None and (p in dropped or (since is not None and p not in since)):
                    return True
                if dropped:
                    dropped.difference_update(ev.block_hashes)
                if since is not None:
                    since.update(ev.block_hashes)
            elif kind is AllBlocksCleared:
                dropped.clear()
                since = self.since_clear[pod] = set()
        return False


def _runs(accepted: list[Accepted]) -> Iterator[list[Accepted] | Accepted]:
    """The batches in runs of at most PIPELINE_BATCHES, and, alone between them, each that must wait for those
    before it to apply (``_Flight``)."""
    flight, run = _Flight(), []
    if len(accepted) == 1:
        yield accepted[0]
        return
    for item in accepted:
        if flight.waits(item[0], item[3]):
            if run:
                yield run
            yield item
            flight, run = _Flight(), []
            continue
        run.append(item)
        if len(run) == PIPELINE_BATCHES:
            yield run
            run = []
    if run:
        yield run
