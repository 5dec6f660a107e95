"""The batch pipeline: messages in arrival order, accepted and planned one by one, applied in pipelined
round trips (at most ``PIPELINE_BATCHES`` batches per trip, two trips in flight).

The seq check still runs per batch inside Valkey, so order and exactly-once hold; a batch not applied at
once (gap, restart, or one behind such a batch) goes through ``Applier.apply``, in order, which recovers; a
pod waiting for a gap's replay has its batches queued behind it there, unplanned.
"""
from __future__ import annotations

import asyncio

from redis.exceptions import ResponseError

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
        runs = [accepted[i:i + PIPELINE_BATCHES] for i in range(0, len(accepted), PIPELINE_BATCHES)]
        if len(runs) == 1 and len(runs[0]) == 1:
            pod, model, seq, batch, errors = runs[0][0]
            await self.applier.apply(pod, model, seq, batch, decode_errors=errors)
            return
        # Two runs in flight: while Valkey applies one, the next is planned and written. A parent planned in
        # either is in no pod's state nor Valkey yet (or in a state loaded again meanwhile): their chain points.
        inflight = None
        chains = ChainState()
        for run in runs:
            plans = [await self.applier.plan(pod, model, seq, batch, errors, chains=chains)
                     for pod, model, seq, batch, errors in run]
            args = [dict(pod_id=pod, rank=batch.data_parallel_rank or 0, seq=seq, ts=batch.ts, model=model,
                         engine_block_size=plan.engine_block_size, groups=plan.groups, mutations=plan.mutations,
                         adapters=plan.adapters)
                    for (pod, model, seq, batch, _), plan in zip(run, plans)]
            try:
                sent = await self.valkey.call(self.index.send_batches, args)
            except ValueError:  # a batch of the run its pod's state log cannot hold: each alone, that one fails
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
        except ResponseError:
            # One batch of the run was refused for good: each goes alone, so only that one fails.
            for pod, model, seq, batch, errors in run:
                await self.applier.apply(pod, model, seq, batch, decode_errors=errors)
            return
        for (pod, model, seq, batch, errors), plan, result in zip(run, plans, results):
            if result.status in ("applied", "dup", "corrupt"):  # corrupt: refused for good, sending it again would not change that
                await self.applier.answered(pod, seq, batch, plan, result)
            else:  # gap or restart, or behind one: the one-batch path re-checks (and counts), recovers
                await self.applier.apply(pod, model, seq, batch, decode_errors=errors)
