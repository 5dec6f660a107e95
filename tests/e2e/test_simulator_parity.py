"""The simulator is faithful: one request sequence, run against it and against a real vLLM 0.32
(both block size 32, the same ``--blocks``), gives the same ``cached_tokens`` for every request,
and the two KV-event streams have the same shape. The same for a hybrid model: the launcher's
tiny-hybrid-model (a sliding-window layer, window 64, beside a full-attention one: two KV cache
groups) against ``simulate --sliding-window 64``.

The workload mixes what decides hits and evictions: shared system prompts, exact
repeats, multi-turn extensions, prompts of exactly whole blocks (the last block is
recomputed and stored again), decode output long enough to fill blocks, fresh long
prompts that force LRU eviction, and two prefix-cache resets. Prompts never contain
generated text, since the simulator's output tokens differ from the model's.

Event streams are compared up to renaming of block hashes (the simulator's hash
function is its own): each hash becomes the index of its first appearance, then
every event must match in type, blocks, parent and token count, batch by batch.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx
import pytest
import zmq

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.engines.vllm import ENGINE as VLLM
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedFrame
from tests.e2e.conftest import VllmSpec
from tests.e2e.harness import spawn, stop, wait_http

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 32  # vLLM 0.32's CPU attention needs a multiple of 32
BLOCKS = 24  # 23 usable: a few long prompts overflow it
MAX_MODEL_LEN = 512
MODEL = "tiny"


# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Call:
    prompt: tuple[int, ...] | None  # None: POST /reset_prefix_cache
    max_tokens: int = 1


def workload(seed: int = 20260301, n: int = 140) -> list[Call]:
    """A reproducible sequence with every situation that moves the prefix cache."""
    rng = random.Random(seed)

    def fresh(k: int) -> list[int]:
        return [rng.randrange(4, 8192) for _ in range(k)]

    systems = [fresh(k) for k in (64, 96, 150, 200)]
    sent: list[list[int]] = []
    calls: list[Call] = []
    for i in range(n):
        if i in (n // 3, 2 * n // 3):
            calls.append(Call(None))
        kind = rng.choices(["system", "repeat", "extend", "whole", "long"], weights=[5, 3, 3, 2, 2])[0]
        if kind == "system" or not sent:
            prompt = rng.choice(systems) + fresh(rng.randint(1, 120))
        elif kind == "repeat":
            prompt = list(rng.choice(sent[-12:]))
        elif kind == "extend":
            prompt = rng.choice(sent[-6:]) + fresh(rng.randint(1, 80))
        elif kind == "whole":
            prompt = (rng.choice(systems) + fresh(64))[: BLOCK_SIZE * rng.randint(2, 5)]
        else:
            prompt = fresh(rng.randint(200, 480))
        prompt = prompt[: MAX_MODEL_LEN - 80]
        max_tokens = rng.choice([1, 1, 2, 5, 16, 31, 32, 33, 64, 70])
        sent.append(prompt)
        calls.append(Call(tuple(prompt), max_tokens))
    return calls


def run_workload(url: str, calls: list[Call]) -> list[int | None]:
    """cached_tokens per call (None for resets, which must succeed)."""
    out: list[int | None] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for call in calls:
            if call.prompt is None:
                r = client.post("/reset_prefix_cache")
                r.raise_for_status()
                assert r.json().get("success", True) is not False
                out.append(None)
                continue
            r = client.post("/v1/completions", json={
                "model": MODEL, "prompt": list(call.prompt), "max_tokens": call.max_tokens,
                "temperature": 0, "ignore_eos": True,
            })
            r.raise_for_status()
            body = r.json()
            assert body["usage"]["completion_tokens"] == call.max_tokens, body["usage"]
            out.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return out


# ---------------------------------------------------------------- events


def replay(endpoint: str, start_seq: int = 0, timeout_s: float = 10) -> list[DecodedFrame]:
    """Everything the engine's replay buffer holds from ``start_seq``, via a DEALER."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        frames: list[DecodedFrame] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                break
            d = VLLM.decode_frames(sock.recv_multipart())
            if d.seq == -1:
                return frames
            frames.append(d)
        raise TimeoutError(f"replay from {endpoint} did not finish")
    finally:
        sock.close(0)
        ctx.term()


def settled_replay(endpoint: str) -> list[DecodedFrame]:
    """Replay until two reads agree: the engine publishes from a queue, a little after responding."""
    previous = replay(endpoint)
    for _ in range(50):
        time.sleep(0.2)
        current = replay(endpoint)
        if len(current) == len(previous):
            return current
        previous = current
    return previous


def canonical(frames: list[DecodedFrame]) -> list[list[tuple]]:
    """Batches of events with hashes renamed to their order of first appearance."""
    names: dict[int, int] = {}

    def name(h: int | None) -> int | None:
        return None if h is None else names.setdefault(h, len(names))

    batches = []
    for frame in frames:
        assert frame.batch is not None and not frame.errors, frame
        events: list[tuple] = []
        for e in frame.batch.events:
            if isinstance(e, BlockStored):
                events.append(("stored", tuple(name(h) for h in e.block_hashes), name(e.parent_block_hash),
                               len(e.token_ids), e.block_size, e.medium, e.group_idx, e.kv_cache_spec_kind,
                               e.kv_cache_spec_sliding_window, e.extra_keys))
            elif isinstance(e, BlockRemoved):
                events.append(("removed", tuple(name(h) for h in e.block_hashes), e.medium, e.group_idx))
            else:
                assert isinstance(e, AllBlocksCleared)
                events.append(("cleared",))
        batches.append(events)
    return batches


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def vllm_engine(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])  # skips, with the reason, when KVPF_VLLM_UP is unset
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def simulator(tmp_path_factory):
    port, zmq_port, replay_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("sim") / "simulator.log"
    proc = spawn(["simulate", "--pod", "sim-parity-sim", "--model", MODEL, "--port", str(port),
                  "--zmq", f"tcp://*:{zmq_port}", "--replay", f"tcp://*:{replay_port}",
                  "--block-size", str(BLOCK_SIZE), "--blocks", str(BLOCKS),
                  "--max-model-len", str(MAX_MODEL_LEN)], str(log))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/v1/models")
        yield url, f"tcp://127.0.0.1:{replay_port}"
    finally:
        stop(proc)


def test_cached_tokens_and_events_match_real_vllm(vllm_engine, simulator):
    calls = workload()
    sim_url, sim_replay = simulator

    real = run_workload(vllm_engine.url, calls)
    sim = run_workload(sim_url, calls)

    requests = [i for i, c in enumerate(calls) if c.prompt is not None]
    mismatches = [(i, real[i], sim[i], len(calls[i].prompt), calls[i].max_tokens) for i in requests
                  if real[i] != sim[i]]
    hits = sum(1 for i in requests if real[i])
    print(f"parity: {len(requests) - len(mismatches)}/{len(requests)} requests match; "
          f"{hits} had cache hits, {sum(real[i] for i in requests)} cached tokens in total")
    assert not mismatches, f"(call, vllm, simulator, prompt len, max_tokens): {mismatches}"
    assert hits >= len(requests) // 4, "the workload should exercise cache hits"

    real_batches = canonical(settled_replay(vllm_engine.replay))
    sim_batches = canonical(settled_replay(sim_replay))
    removed = sum(1 for b in real_batches for e in b if e[0] == "removed")
    print(f"events: vLLM {len(real_batches)} batches ({removed} removals), simulator {len(sim_batches)} batches")
    assert removed > 20, "the workload should force evictions"
    assert [e for b in sim_batches for e in b] == [e for b in real_batches for e in b]
    assert sim_batches == real_batches


# ---------------------------------------------------------------- hybrid (two KV cache groups)

HYBRID_BLOCKS = 40  # vLLM needs two groups' blocks for a 512-token request; 39 usable still overflow
SLIDING_WINDOW = 64  # tiny-hybrid-model's
# the real engines, in test order (tests/e2e/conftest.py starts each ahead)
VLLM_ENGINES = (VllmSpec("sim-parity", BLOCKS), VllmSpec("sim-parity-hybrid", HYBRID_BLOCKS, hybrid=True))


@pytest.fixture(scope="module")
def hybrid_vllm_engine(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[1])
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def hybrid_simulator(tmp_path_factory):
    port, zmq_port, replay_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("sim-hybrid") / "simulator.log"
    proc = spawn(["simulate", "--pod", "sim-parity-hybrid-sim", "--model", MODEL, "--port", str(port),
                  "--zmq", f"tcp://*:{zmq_port}", "--replay", f"tcp://*:{replay_port}",
                  "--block-size", str(BLOCK_SIZE), "--blocks", str(HYBRID_BLOCKS),
                  "--max-model-len", str(MAX_MODEL_LEN), "--sliding-window", str(SLIDING_WINDOW)], str(log))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/v1/models")
        yield url, f"tcp://127.0.0.1:{replay_port}"
    finally:
        stop(proc)


def test_hybrid_cached_tokens_and_events_match_real_vllm(hybrid_vllm_engine, hybrid_simulator):
    """The same workload: its shared system prompts and extensions are where the window group lags the
    full-attention one (a hit cut short, then the junction's window blocks cached), its long prompts evict
    both groups' blocks from the one pool."""
    calls = workload()
    sim_url, sim_replay = hybrid_simulator

    real = run_workload(hybrid_vllm_engine.url, calls)
    sim = run_workload(sim_url, calls)

    requests = [i for i, c in enumerate(calls) if c.prompt is not None]
    mismatches = [(i, real[i], sim[i], len(calls[i].prompt), calls[i].max_tokens) for i in requests
                  if real[i] != sim[i]]
    hits = sum(1 for i in requests if real[i])
    print(f"hybrid parity: {len(requests) - len(mismatches)}/{len(requests)} requests match; {hits} had cache hits")
    assert not mismatches, f"(call, vllm, simulator, prompt len, max_tokens): {mismatches}"
    assert hits >= len(requests) // 4, "the workload should exercise cache hits"

    real_batches = canonical(settled_replay(hybrid_vllm_engine.replay))
    sim_batches = canonical(settled_replay(sim_replay))
    events = [e for b in real_batches for e in b]
    removed = {e[3] for e in events if e[0] == "removed"}
    partial = sum(1 for e in events if e[0] == "stored" and e[6] == 0 and e[1] != ())
    print(f"events: vLLM {len(real_batches)} batches, {len(events)} events; simulator {len(sim_batches)} batches")
    assert removed == {0, 1}, "the workload should evict both groups' blocks"
    assert any(e[0] == "stored" and e[6] == 0 and e[1] == () for e in events), \
        "the window group should send a BlockStored with no cached block"
    assert partial > 0
    assert [e for b in sim_batches for e in b] == events
    assert sim_batches == real_batches
