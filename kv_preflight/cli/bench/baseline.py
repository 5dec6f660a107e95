"""The benchmark's baselines: the straightforward seed design, run in the same benchmark.

Predictor (a server, same HTTP stack as ``kv-preflight serve``):

Per request: stdlib ``json`` parses the body, request keys come from the pure-Python
reference (cbor2 + FNV per block, ``kv_preflight.keys.chain.request_keys_reference``), one
pipelined ``HKEYS`` per block (``Index.fields_per_key``, llm-d's own Lookup) fetches
the fields, and ``longest_prefix`` + ``score`` run in Python. Pod metadata comes from
the same ~1 s cache the real predictor uses, so the ratio isolates the hot path.
It runs under uvicorn exactly as ``kv-preflight serve`` does (uvloop, httptools, workers).

Ingestion (``seed_ingest``): the seed's decoder, keys, apply script and one round trip per batch.

    python -m kv_preflight.cli.bench.baseline --valkey-url URL --port P --workers 2
"""
from __future__ import annotations

import argparse
import json

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kv_preflight.predictor.metadata import IndexMetadata
from kv_preflight.predictor.scoring.score import score
from kv_preflight.index.index import Index, longest_prefix
from kv_preflight.keys.chain import request_keys_reference

BLOCK = 16


def create_app(valkey_url: str) -> Starlette:
    index = Index.from_url(valkey_url)
    metadata = IndexMetadata(index)

    async def predict(request: Request) -> Response:
        body = json.loads(await request.body())
        tokens, model, pods = body["token_ids"], body["model"], body.get("pods")
        keys = request_keys_reference(tokens, model=model, block_size=BLOCK)
        matches = longest_prefix(await index.fields_per_key(keys), pods) if keys else []
        infos = await metadata.pod_infos(m.pod_id for m in matches)
        pred = score(matches, prompt_len=len(tokens), canonical_block=BLOCK,
                     engine_blocks={p: i.engine_block_size for p, i in infos.items()},
                     incomplete={p for p, i in infos.items() if i.incomplete}, pods=pods)
        return Response(json.dumps(msgspec.to_builtins(pred)), media_type="application/json")

    return Starlette(routes=[Route("/v1/cache/predict", predict, methods=["POST"])])


def app_from_env() -> Starlette:
    import os

    return create_app(os.environ["KVPF_BENCH_VALKEY_URL"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--valkey-url", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args()
    import os

    os.environ["KVPF_BENCH_VALKEY_URL"] = a.valkey_url
    uvicorn.run("kv_preflight.cli.bench.baseline:app_from_env", factory=True, host="127.0.0.1", port=a.port, workers=a.workers,
                loop="uvloop", http="httptools", access_log=False, log_level="warning", lifespan="off")


# ---------------------------------------------------------------- ingestion baseline (the seed design)

# The seed's apply script, verbatim (first commit, kv_preflight/index/index.py): per stored block the whole
# PodEntry field travels and is kept in kvpf:blocks, one ZADD and one EXISTS per request key.
SEED_APPLY = r"""
local function clear_pod(blocks_key)
  local n = 0
  local all = redis.call('HGETALL', blocks_key)
  for i = 1, #all, 2 do
    local ek = string.match(all[i], '^([^|]*)')
    local ekey = 'engine:' .. ek
    local rks = redis.call('ZRANGE', ekey, 0, -1)
    local alive = false
    for _, rk in ipairs(rks) do
      redis.call('HDEL', rk, all[i + 1])
      if redis.call('EXISTS', rk) == 1 then alive = true end
    end
    if not alive then redis.call('DEL', ekey) end
    n = n + 1
  end
  redis.call('DEL', blocks_key)
  return n
end

local pod, rank = ARGV[1], ARGV[2]
local seq, ts, mode = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local meta = 'kvpf:seed-pod:' .. pod
local blocks = 'kvpf:seed-blocks:' .. pod
local last = redis.call('HGET', meta, 'seq:' .. rank)
local last_n = -1
if last then last_n = tonumber(last) end
if mode == 'check' then
  if last then
    if seq <= last_n then
      local last_ts = tonumber(redis.call('HGET', meta, 'ts:' .. rank) or '0')
      if ts > last_ts then return {'restart', last_n} end
      return {'dup', last_n}
    end
    if seq > last_n + 1 then return {'gap', last_n} end
  elseif seq > 0 then
    return {'gap', -1}
  end
end
if mode == 'reset' then
  clear_pod(blocks)
  redis.call('HINCRBY', meta, 'restarts', 1)
end
local stored, removed, cleared = 0, 0, 0
local i = 9
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local ek, tier, fld, n = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
    local ekey = 'engine:' .. ek
    redis.call('HSET', blocks, ek .. '|' .. tier, fld)
    for j = 1, n do
      local rk = ARGV[i + 4 + j]
      redis.call('ZADD', ekey, j - 1, rk)
      redis.call('HSET', rk, fld, '')
    end
    stored = stored + 1
    i = i + 5 + n
  elseif op == 'R' then
    local ek, tier = ARGV[i + 1], ARGV[i + 2]
    local bk = ek .. '|' .. tier
    local fld = redis.call('HGET', blocks, bk)
    if fld then
      redis.call('HDEL', blocks, bk)
      local ekey = 'engine:' .. ek
      local rks = redis.call('ZRANGE', ekey, 0, -1)
      local alive = false
      for _, rk in ipairs(rks) do
        redis.call('HDEL', rk, fld)
        if redis.call('EXISTS', rk) == 1 then alive = true end
      end
      if not alive then redis.call('DEL', ekey) end
      removed = removed + 1
    end
    i = i + 3
  elseif op == 'C' then
    clear_pod(blocks)
    cleared = cleared + 1
    i = i + 1
  else
    return redis.error_reply('unknown op ' .. tostring(op))
  end
end
redis.call('HSET', meta, 'seq:' .. rank, seq, 'ts:' .. rank, ARGV[4], 'model', ARGV[6],
           'last_event_time', ARGV[8])
if ARGV[7] ~= '' then redis.call('HSET', meta, 'engine_block_size', ARGV[7]) end
if mode == 'force' and last and seq > last_n + 1 then
  redis.call('HINCRBY', meta, 'gaps_accepted', 1)
end
redis.call('HINCRBY', meta, 'batches', 1)
if stored > 0 then redis.call('HINCRBY', meta, 'stored', stored) end
if removed > 0 then redis.call('HINCRBY', meta, 'removed', removed) end
if cleared > 0 then redis.call('HINCRBY', meta, 'cleared', cleared) end
redis.call('HSET', 'kvpf:seed-pods', pod, ARGV[6])
return {'applied', last_n}
"""


async def seed_ingest(url: str, frames: list) -> tuple[float, dict]:
    """The seed ingestion path: the tolerant per-event decoder, pure-Python keys (cbor2 + FNV),
    one redis-py EVALSHA per batch awaited before the next (``frames``: [(pod, [topic, seq, payload])])."""
    import time

    import redis.asyncio as aioredis

    from kv_preflight.ingester import bridge
    from kv_preflight.ingester.bridge import ChainState, plan_batch, seed_state, unresolved_parents
    from kv_preflight import events
    from kv_preflight.engines import engine
    from kv_preflight.index.index import RemoveBlock, StoreBlock, encode_entry, engine_key_name, make_entry
    from kv_preflight.keys.chain import request_keys_reference

    client = aioredis.from_url(url, socket_timeout=10.0)
    script = client.register_script(SEED_APPLY)
    vllm = engine("vllm")  # the simulator publishes vLLM's frames
    state = ChainState()
    stats = {"batches_applied": 0, "blocks_stored": 0, "blocks_removed": 0}
    saved = bridge.request_keys
    bridge.request_keys = request_keys_reference
    try:
        t = time.perf_counter()
        for _, (topic_raw, seq_raw, payload) in frames:
            topic = events.parse_topic(topic_raw)
            seq = events.parse_seq(seq_raw)
            raw = events._msgpack.decode(payload)
            batch = events.EventBatch(ts=float(raw[0]), events=[events.decode_event(e, vllm.layout) for e in raw[1]],
                                      data_parallel_rank=raw[2] if len(raw) > 2 else None)
            missing = unresolved_parents(batch, topic.model, state)
            if missing:
                async with client.pipeline(transaction=False) as pipe:
                    for _, ek in missing:
                        pipe.zrange(engine_key_name(ek), -1, -1)
                    replies = await pipe.execute()
                seed_state(state, {(m, ek): int(r[0]) for (m, ek), r in zip(missing, replies) if r})
            plan = plan_batch(batch, pod_id=topic.pod_id, topic_model=topic.model, state=state, hash_seed="",
                              block_size=16, entry_field=lambda p, m, g: encode_entry(make_entry(p, m, g)),
                              extra_keys=vllm.extra_keys)
            args = [topic.pod_id, batch.data_parallel_rank or 0, seq, repr(batch.ts), "check", topic.model,
                    plan.engine_block_size or "", repr(time.time())]
            for m in plan.mutations:
                if isinstance(m, StoreBlock):
                    args += ["S", m.engine_key, m.tier, m.entry_field, len(m.request_keys), *m.request_keys]
                elif isinstance(m, RemoveBlock):
                    args += ["R", m.engine_key, m.tier]
                else:
                    args.append("C")
            status, _ = await script(keys=[], args=args)
            if status == b"applied":
                stats["batches_applied"] += 1
                stats["blocks_stored"] += plan.stored_blocks
                stats["blocks_removed"] += plan.removed_blocks
        elapsed = time.perf_counter() - t
    finally:
        bridge.request_keys = saved
        await client.aclose()
    return elapsed, stats


if __name__ == "__main__":
    main()
