"""Hostile input against real `kv-preflight ingest` processes, over real ZMQ, into a real Valkey.

One ingester process takes every group of bad frames below (hypothesis-generated where a space is
large: random bytes, wrong types at every field, truncated real frames, huge arrays, deep nesting,
non-UTF-8 topics, wrong frame counts and seq lengths, well-typed but absurd values, a frame over
--max-frame-bytes). After each group a well-formed batch of a canary pod must be indexed, and at the
end the process must be alive, with the bad frames counted and its peak memory bounded.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.events import BlockStored, EventBatch, encode_frames
from kv_preflight.index.index import Index
from kv_preflight.index.layout import pod_meta_key, pod_state_key
from tests.conftest import fixture_path
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.engine_stub import EngineStub
from tests.prom import metric

pytestmark = [pytest.mark.integration]

MIB = 1024 * 1024
FIXTURE = [json.loads(line) for line in fixture_path("vllm-0.32-live-frames.jsonl").read_text().splitlines() if line]
REAL_FRAMES = [[o["topic"].encode(), o["seq"].to_bytes(8, "big"), base64.b64decode(o["payload_b64"])] for o in FIXTURE]
VICTIM = b"kv@victim@tiny"
FIELDS = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                          "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                          "kv_cache_spec_sliding_window", "type"],
          "BlockRemoved": ["block_hashes", "medium", "group_idx", "type"]}
SETTINGS = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 64 - 1), st.floats(), st.text(max_size=12),
                 st.binary(max_size=12))
any_value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                         max_leaves=10)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def nested(depth: int, inner: bytes = b"\xc0") -> bytes:
    """msgpack: ``depth`` one-element arrays around ``inner``, built without recursion."""
    return b"\x91" * depth + inner


def map_with(base: dict, key: str, raw_value: bytes) -> bytes:
    """msgpack of ``base`` plus ``key`` whose value is the raw msgpack ``raw_value`` (a fixmap)."""
    body = {k: v for k, v in base.items() if k != key}
    head = msgspec.msgpack.encode(body)
    assert head[0] & 0xF0 == 0x80 and len(body) < 15
    return bytes([0x80 | (len(body) + 1)]) + head[1:] + msgspec.msgpack.encode(key) + raw_value


def payload_of(*raw_events: bytes, ts: bytes | None = None) -> bytes:
    return (b"\x93" + (ts or msgspec.msgpack.encode(time.time())) + bytes([0x90 | len(raw_events)])
            + b"".join(raw_events) + b"\x00")


def wire_events() -> list[dict]:
    return [ev for fr in REAL_FRAMES for ev in msgspec.msgpack.decode(fr[2])[1]]


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024


class Canary:
    """A pod whose well-formed batches only this test sends: each one must get indexed."""

    def __init__(self, pub: zmq.Socket, ix: Index, loop: asyncio.AbstractEventLoop, pod: str = "canary"):
        self.pub, self.ix, self.loop, self.pod = pub, ix, loop, pod
        self.seq = 0

    def batch(self, seq: int) -> EventBatch:
        tokens = [(seq * 16 + i) % 30_000 + 1 for i in range(16)]
        return EventBatch(time.time(), [BlockStored([500_000 + seq], None, tokens, 16, medium="GPU", group_idx=0,
                                                    extra_keys=[None])], 0)

    def info(self):
        return self.loop.run_until_complete(self.ix.meta.pod_info(self.pod))

    def counters(self) -> dict[str, int]:
        return self.loop.run_until_complete(self.ix.meta.counters())

    def publish_and_wait(self, proc, timeout_s: float = 15.0) -> None:
        """Publish the next batch until one is indexed (a frame sent while the publisher reconnects is
        lost: the next seq is then a gap, which a --bind socket cannot replay, so it applies flagged)."""
        deadline = time.monotonic() + timeout_s
        while True:
            seq = self.seq
            self.seq += 1
            self.pub.send_multipart(encode_frames(f"kv@{self.pod}@tiny", seq, self.batch(seq)))
            resend = time.monotonic() + 1.0
            while time.monotonic() < resend:
                if self.info().seqs.get("0", -1) >= seq:
                    return
                assert proc.poll() is None, "the ingester died"
                time.sleep(0.005)
            assert time.monotonic() < deadline, f"canary batch never indexed: {self.info()}"


@contextlib.contextmanager
def ingester(valkey_url: str, tmp_path: Path, *args: str):
    mport = free_port()
    log = tmp_path / f"ingest-{mport}.log"
    proc = spawn(["ingest", "--valkey-url", valkey_url, "--metrics-port", str(mport), *args], str(log))
    try:
        wait_http(f"http://127.0.0.1:{mport}/metrics")
        yield proc, f"http://127.0.0.1:{mport}/metrics", log
    finally:
        stop(proc)


def test_hostile_frames_are_counted_and_never_stop_one_ingester(valkey_url, tmp_path):
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    loop = asyncio.new_event_loop()
    ix = Index.from_url(valkey_url)
    started = time.monotonic()
    with ingester(valkey_url, tmp_path, "--bind", f"tcp://127.0.0.1:{port}") as (proc, metrics_url, log):
        try:
            pub.connect(f"tcp://127.0.0.1:{port}")
            canary = Canary(pub, ix, loop)
            canary.publish_and_wait(proc, timeout_s=30)  # also waits out ZMQ's slow joiner
            sent_bad = 0  # frames every decoder must reject: the counter must grow by at least this

            def send(frames_list: list[list[bytes]], certainly_bad: bool = False) -> None:
                nonlocal sent_bad
                before = canary.counters().get("decode_errors", 0)
                for frames in frames_list:
                    pub.send_multipart(frames)
                canary.publish_and_wait(proc)  # same socket, in order: the group was handled before it
                if certainly_bad:
                    sent_bad += len(frames_list)
                    assert canary.counters().get("decode_errors", 0) - before >= len(frames_list)

            # Random frames, any count (0-frame messages cannot be sent, so at least one).
            @SETTINGS
            @given(st.lists(st.lists(st.binary(max_size=64), min_size=1, max_size=6), min_size=1, max_size=4))
            def random_frames(group):
                send(group)
            random_frames()

            # Random payload bytes under a plausible topic and seq.
            @SETTINGS
            @given(st.lists(st.binary(max_size=256), min_size=1, max_size=4), st.integers(0, 2 ** 20))
            def random_payloads(payloads, seq):
                send([[VICTIM, seq_bytes(seq), p] for p in payloads])
            random_payloads()

            # A wrong type at every field of every event kind, and of the batch itself.
            events = wire_events()
            templates = {kind: next(e for e in events if e["type"] == kind) for kind in FIELDS}
            group = []
            for kind, names in FIELDS.items():
                for name in names:
                    for wrong in ({"x": 1}, "text", -1.5, [[["deep"]]], None if name == "type" else b"\xff" * 9):
                        ev = dict(templates[kind], **{name: wrong})
                        group.append([VICTIM, seq_bytes(10), msgspec.msgpack.encode([time.time(), [ev], 0])])
            for ts, evs, rank in (("now", [], 0), (1.0, {"a": 1}, 0), (1.0, [], "zero"), (None, None, None)):
                group.append([VICTIM, seq_bytes(11), msgspec.msgpack.encode([ts, evs, rank])])
            send(group)

            @SETTINGS
            @given(st.sampled_from(sorted(FIELDS)), st.data())
            def wrong_types(kind, data):
                name = data.draw(st.sampled_from(FIELDS[kind] + ["unknown_field"]))
                value = data.draw(any_value)
                ev = dict(templates[kind], **{name: value})
                batch = data.draw(st.sampled_from(["ok", "ts", "rank", "extra"]))
                wire = [time.time(), [ev], 0]
                if batch == "ts":
                    wire[0] = value
                elif batch == "rank":
                    wire[2] = value
                elif batch == "extra":
                    wire.append(value)
                send([[VICTIM, seq_bytes(data.draw(st.integers(0, 2 ** 40))), msgspec.msgpack.encode(wire)]])
            wrong_types()

            # Truncations of the real vLLM 0.32 frames, in any of the three frames.
            @SETTINGS
            @given(st.sampled_from(range(len(REAL_FRAMES))), st.sampled_from([0, 1, 2]), st.data())
            def truncated(i, which, data):
                frames = list(REAL_FRAMES[i])
                frames[which] = frames[which][:data.draw(st.integers(0, max(0, len(frames[which]) - 1)))]
                frames[0] = VICTIM if which != 0 else frames[0]
                send([frames])
            truncated()

            # Huge arrays: headers claiming 2^32-1 elements (no data behind them), and real large ones
            # of a wrong element type, as events, hashes, tokens and the batch itself.
            claims = [kind + b"\xff" * 4 for kind in (b"\xdd", b"\xdf", b"\xdb", b"\xc6")]  # array, map, str, bin
            stored = templates["BlockStored"]
            group = [[VICTIM, seq_bytes(20), b"\x93\xcb" + bytes(8) + c] for c in claims]
            group += [[VICTIM, seq_bytes(21), payload_of(map_with(stored, f, c))] for f in ("block_hashes", "token_ids")
                      for c in claims]
            strings = dict(stored, block_hashes=["h"] * 500_000)
            group.append([VICTIM, seq_bytes(22), msgspec.msgpack.encode([time.time(), [strings], 0])])
            group.append([VICTIM, seq_bytes(23), msgspec.msgpack.encode([time.time(), [None] * 1_000_000, 0])])
            send(group, certainly_bad=True)

            # Deep nesting, in a kept field, a skipped field, the events and the batch.
            @SETTINGS
            @given(st.integers(900, 200_000), st.sampled_from(["extra_keys", "unknown", "events", "batch", "ts"]))
            def deep(depth, where):
                if where in ("extra_keys", "unknown"):
                    payload = payload_of(map_with(stored, where, nested(depth)))
                elif where == "events":
                    payload = b"\x93\xcb" + bytes(8) + nested(depth) + b"\x00"
                elif where == "ts":
                    payload = payload_of(ts=nested(depth))
                else:
                    payload = nested(depth)
                send([[VICTIM, seq_bytes(30), payload]], certainly_bad=where != "unknown" or depth >= 1000)
            deep()

            # Non-UTF-8 topics: a decode error each, never a pod named "\ufffd".
            @SETTINGS
            @given(st.binary(min_size=1, max_size=8).filter(lambda b: not _utf8(b)))
            def non_utf8(junk):
                send([[b"kv@" + junk + b"@tiny", seq_bytes(0), REAL_FRAMES[0][2]],
                      [b"kv@pod@" + junk, seq_bytes(0), REAL_FRAMES[0][2]]], certainly_bad=True)
            non_utf8()

            # Wrong frame counts (a real frame's parts, too few or too many) and seq frames of wrong lengths.
            @SETTINGS
            @given(st.sampled_from([1, 2, 5, 6, 9]), st.binary(max_size=20).filter(lambda b: len(b) != 8))
            def wrong_shapes(count, seq_raw):
                real = [VICTIM, seq_bytes(40), REAL_FRAMES[1][2]]
                send([(real * 3)[:count] if count != 2 else [VICTIM, REAL_FRAMES[1][2]],
                      [VICTIM, seq_raw, REAL_FRAMES[1][2]]], certainly_bad=True)
            wrong_shapes()

            # Well-typed but absurd values: they decode, so they must apply (or be refused) without
            # stalling the ingester.
            @SETTINGS
            @given(st.data())
            def absurd(data):
                ev = dict(stored,
                          medium=data.draw(st.sampled_from(["GPU|cpu", "{\"x\":", "é\u2028", "", "a" * 300])),
                          lora_name=data.draw(st.sampled_from([None, "", "a@b", "x" * 500, "\x00"])),
                          group_idx=data.draw(st.sampled_from([None, 0, -1, 2 ** 63 - 1, 2 ** 64 - 1])),
                          block_size=data.draw(st.sampled_from([1, 16, 2 ** 62])),
                          parent_block_hash=data.draw(st.sampled_from([None, 0, 2 ** 64 - 1, -1])))
                ts = data.draw(st.sampled_from([0.0, -1.0, 1e300, float("nan"), float("inf")]))
                rank = data.draw(st.sampled_from([0, None, -7, 2 ** 63 - 1]))
                seq = data.draw(st.sampled_from([0, 1, 2 ** 32 + 5, 2 ** 62, 2 ** 63 - 1]))
                pod = data.draw(st.sampled_from([b"victim", b"v|x", b"v\"q", b"v:pod:x", b"\xc3\xa9"]))
                send([[b"kv@" + pod + b"@tiny", seq_bytes(seq), msgspec.msgpack.encode([ts, [ev], rank])]])
            absurd()

            # A frame over --max-frame-bytes (40 MiB > 32 MiB): ZMQ drops the connection unread,
            # the publisher reconnects, the canary goes on.
            send([[VICTIM, seq_bytes(50), b"\x00" * (40 * MIB)]])

            assert proc.poll() is None
            counters = canary.counters()
            assert counters.get("decode_errors", 0) >= sent_bad > 0
            scraped = httpx.get(metrics_url, timeout=5).text
            assert metric(scraped, "kvpf_ingest_decode_errors_total") == counters["decode_errors"]
            assert peak_rss_mb(proc.pid) < 300, f"peak RSS {peak_rss_mb(proc.pid):.0f} MB"
            assert not any("\ufffd" in p for p in loop.run_until_complete(ix.meta.pod_ids()))
            assert "Traceback" not in log.read_text()
            assert time.monotonic() - started < 60
        finally:
            pub.close()
            ctx.term()
            loop.run_until_complete(ix.close())
            loop.close()


@dataclasses.dataclass
class Bound:
    """An ingester process on a --bind socket, a PUB connected to it and a canary pod already indexed."""

    proc: Any
    metrics_url: str
    log: Path
    pub: zmq.Socket
    ix: Index
    loop: asyncio.AbstractEventLoop
    canary: Canary


@contextlib.contextmanager
def bound_ingester(valkey_url: str, tmp_path: Path):
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    loop = asyncio.new_event_loop()
    ix = Index.from_url(valkey_url)
    with ingester(valkey_url, tmp_path, "--bind", f"tcp://127.0.0.1:{port}") as (proc, metrics_url, log):
        try:
            pub.connect(f"tcp://127.0.0.1:{port}")
            canary = Canary(pub, ix, loop)
            canary.publish_and_wait(proc, timeout_s=30)
            yield Bound(proc, metrics_url, log, pub, ix, loop, canary)
        finally:
            pub.close()
            ctx.term()
            loop.run_until_complete(ix.close())
            loop.close()


def test_deep_nesting_and_a_non_utf8_topic_are_decode_errors_not_a_crash_or_a_pod(valkey_url, tmp_path):
    """The findings: an event nested 1,000+ levels deep made RecursionError escape the decoder and
    killed the ingester; a non-UTF-8 topic became a pod named "\ufffd\ufffd"."""
    with bound_ingester(valkey_url, tmp_path) as b:
        stored = next(e for e in wire_events() if e["type"] == "BlockStored")
        b.pub.send_multipart([VICTIM, seq_bytes(0), payload_of(map_with(stored, "extra_keys", nested(5000)))])
        b.pub.send_multipart([VICTIM, seq_bytes(0), payload_of(map_with(stored, "future_field", nested(5000)))])
        b.pub.send_multipart([b"kv@\xff\xfe@tiny", seq_bytes(0), REAL_FRAMES[0][2]])
        b.canary.publish_and_wait(b.proc)
        assert b.proc.poll() is None
        assert b.canary.counters().get("decode_errors") == 3
        assert metric(httpx.get(b.metrics_url, timeout=5).text, "kvpf_ingest_decode_errors_total") == 3
        assert set(b.loop.run_until_complete(b.ix.meta.pod_ids())) == {"canary"}
        text = b.log.read_text()
        assert "is not UTF-8" in text and "recursion limit" in text and "Traceback" not in text


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def big_stored_payload(n_tokens: int) -> bytes:
    """A well-formed BlockStored of ``n_tokens`` tokens (5 bytes each on the wire, ~10x that decoded),
    built straight as msgpack so the test itself never holds the list."""
    head = {"type": "BlockStored", "block_hashes": [77], "parent_block_hash": None, "block_size": 16,
            "lora_id": None, "medium": "GPU", "lora_name": None}
    tokens = b"\xdd" + n_tokens.to_bytes(4, "big") + b"\xce\x00\x01\x00\x00" * n_tokens
    return payload_of(map_with(head, "token_ids", tokens))


def test_a_100mb_frame_is_a_flagged_gap_not_a_memory_spike(valkey_url, tmp_path):
    """The finding: one 100 MB frame took the ingester to ~900 MB. Now ZMQ drops the connection before
    allocating it (ZMQ_MAXMSGSIZE), the subscriber reconnects, and the replay that would send the
    same frame again ends at the drop: the gap is flagged, never retried in a loop."""
    zport, rport = free_port(), free_port()
    engine = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", "kv@big@tiny")
    loop = asyncio.new_event_loop()
    ix = Index.from_url(valkey_url)
    source = f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport}"
    try:
        with ingester(valkey_url, tmp_path, "--source", source) as (proc, metrics_url, log):
            def seq() -> int:
                return loop.run_until_complete(ix.meta.pod_info("big")).seqs.get("0", -1)

            def good(i: int) -> EventBatch:
                return EventBatch(time.time(), [BlockStored([1000 + i], None, [100 + i] * 16, 16, medium="GPU",
                                                            group_idx=0, extra_keys=[None])], 0)

            engine.publish(good(0))  # lost or not (slow joiner), the replay brings it
            deadline = time.monotonic() + 20
            while seq() < 0:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            before = peak_rss_mb(proc.pid)
            payload = big_stored_payload(20_000_000)
            assert len(payload) > 100 * 10 ** 6
            with engine._lock:  # published and kept for replay, like any batch
                big_seq = engine.seq
                frames = [engine.topic.encode(), seq_bytes(big_seq), payload]
                engine.buffer.append((big_seq, frames))
                engine.seq += 1
            engine.pub.send_multipart(frames)
            del frames, payload
            deadline = time.monotonic() + 30
            while seq() < engine.seq - 1 or seq() <= big_seq:  # (c) the next well-formed batch is indexed
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                assert proc.poll() is None, log.read_text()[-3000:]  # (b) alive
                engine.publish(good(engine.seq))
                time.sleep(0.3)
            info = loop.run_until_complete(ix.meta.pod_info("big"))
            assert info.blocks >= 2
            assert peak_rss_mb(proc.pid) < 300, (before, peak_rss_mb(proc.pid))  # (a)
            assert info.incomplete and str(big_seq) in info.incomplete_reason  # (d) flagged, with the reason
            scraped = httpx.get(metrics_url, timeout=5).text
            assert metric(scraped, "kvpf_ingest_gaps_unrecovered_total", pod="big") >= 1
            time.sleep(1.0)  # no replay loop: the replay count stays where it is once the gap is flagged
            replays = metric(httpx.get(metrics_url, timeout=5).text, "kvpf_ingest_replays_total", pod="big")
            time.sleep(2.0)
            assert metric(httpx.get(metrics_url, timeout=5).text, "kvpf_ingest_replays_total", pod="big") == replays
            assert proc.poll() is None
    finally:
        engine.close()
        loop.run_until_complete(ix.close())
        loop.close()


def test_a_batch_past_what_a_pod_state_holds_fails_alone_and_the_pod_moves_on(valkey_url, tmp_path):
    """A batch naming 17 device tiers at once (a pod's state log holds 16) could not be written: the ValueError
    left the ingest loop and ended the process. Now that batch fails alone (logged, counted), the next one is
    a gap with nothing to replay it from (a --bind socket), applied with the pod flagged, and other pods go on."""
    with bound_ingester(valkey_url, tmp_path) as b:
        tiers = [BlockStored([900_000 + i], None, [i + 1] * 16, 16, medium=f"TIER{i}", group_idx=0, extra_keys=[None])
                 for i in range(17)]
        b.pub.send_multipart(encode_frames("kv@victim@tiny", 0, EventBatch(time.time(), tiers, 0)))
        b.canary.publish_and_wait(b.proc)
        assert b.proc.poll() is None, b.log.read_text()[-2000:]
        victim = Canary(b.pub, b.ix, b.loop, pod="victim")
        victim.seq = 1
        victim.publish_and_wait(b.proc)
        info = victim.info()
        assert info.incomplete and "were missed" in info.incomplete_reason, info
        assert metric(httpx.get(b.metrics_url, timeout=5).text, "kvpf_ingest_apply_errors_total") >= 1
        text = b.log.read_text()
        assert "batch cannot be written" in text and "Traceback" not in text
        b.canary.publish_and_wait(b.proc)


def test_a_pod_whose_state_log_does_not_read_is_flagged_and_the_others_go_on(valkey_url, tmp_path):
    """A pod's state log holding junk (a hand edit, a bug, a build that writes another format): restoring it raised
    the decoder's error out of the ingest loop and ended the process, and would every process that took the pod
    over after it; found on a reload (another writer moved the pod), the batch was logged as not written and the
    pod left exact. Now the pod's batches fail alone (logged, counted) and the pod is flagged, in a process that
    finds the junk on a reload and in one that starts with it; other pods go on."""
    def junk_log() -> None:
        async def write() -> None:
            await b.ix.client.hset(pod_state_key("victim"), "s", msgspec.msgpack.encode([1, "not a snapshot"]))
            await b.ix.client.hset(pod_meta_key("victim"), "gen", "999:elsewhere")  # another writer moved it
            await b.ix.meta.mark_complete("victim")
        b.loop.run_until_complete(write())

    def flagged(victim: Canary, seq: int) -> str:
        """The victim's batch at ``seq`` sent (again each second: a frame sent as the publisher reconnects is
        lost) until the pod is flagged; the flag's reason."""
        deadline = time.monotonic() + 15
        while True:
            victim.pub.send_multipart(encode_frames("kv@victim@tiny", seq, victim.batch(seq)))
            resend = time.monotonic() + 1.0
            while time.monotonic() < resend:
                info = victim.info()
                if info.incomplete:
                    return info.incomplete_reason
                assert b.proc.poll() is None, "the ingester died: " + b.log.read_text()[-2000:]
                time.sleep(0.05)
            assert time.monotonic() < deadline, (info, b.log.read_text()[-1500:])

    with bound_ingester(valkey_url, tmp_path) as b:
        victim = Canary(b.pub, b.ix, b.loop, pod="victim")
        victim.publish_and_wait(b.proc)  # the pod, held and loaded by the ingester: seq 0
        junk_log()
        assert "state log does not read" in flagged(victim, 1)
        b.canary.publish_and_wait(b.proc)
        assert metric(httpx.get(b.metrics_url, timeout=5).text, "kvpf_ingest_apply_errors_total") >= 1
        assert "Traceback" not in b.log.read_text()
    with bound_ingester(valkey_url, tmp_path) as b:  # a process that starts with the pod's log as it is
        b.canary.seq = 2
        b.canary.publish_and_wait(b.proc)
        junk_log()
        assert "state log does not read" in flagged(Canary(b.pub, b.ix, b.loop, pod="victim"), 1)
        b.canary.publish_and_wait(b.proc)
        assert "Traceback" not in b.log.read_text()


def test_a_pod_whose_state_log_does_not_read_is_cleared_by_a_scan_while_its_ingester_runs(valkey_url, tmp_path):
    """A pod flagged for a state log that does not read stayed so for good, its entries in the index. `index clear
    --scan`, run while its ingester runs and refuses its batches, removes them (the canary's entries on the same
    request keys stay: the two pods' batches store the same blocks), and the pod's next batch is applied by the
    ingester (past the gap its refused batch left, flagged, as a clear leaves a pod)."""
    import subprocess
    import sys

    from kv_preflight.index.transfer import held_blocks

    with bound_ingester(valkey_url, tmp_path) as b:
        victim = Canary(b.pub, b.ix, b.loop, pod="victim")
        for _ in range(3):
            victim.publish_and_wait(b.proc)  # seq 0..2: the canary's blocks of seq 0..2, shared
        while b.canary.seq < 3:
            b.canary.publish_and_wait(b.proc)
        rks = [rk for rks, _ in b.loop.run_until_complete(held_blocks(b.ix.writer, "victim")).values() for rk in rks]
        canary_blocks = b.canary.info().blocks

        def owners() -> list[list[str]]:
            return [sorted(json.loads(f)["PodIdentifier"] for f in b.loop.run_until_complete(b.ix.client.hkeys(str(rk))))
                    for rk in rks]

        before = owners()
        assert sum(pods == ["canary", "victim"] for pods in before) >= 2, before  # shared request keys
        b.loop.run_until_complete(b.ix.client.hset(pod_state_key("victim"), "s", b"\xc1junk"))
        b.loop.run_until_complete(b.ix.client.hset(pod_meta_key("victim"), "gen", "999:elsewhere"))
        deadline = time.monotonic() + 15
        while "state log does not read" not in (info := victim.info()).incomplete_reason:
            b.pub.send_multipart(encode_frames("kv@victim@tiny", 3, victim.batch(3)))  # refused
            time.sleep(0.3)
            assert time.monotonic() < deadline, (info, b.log.read_text()[-1500:])
        out = subprocess.run([sys.executable, "-m", "kv_preflight", "index", "clear", "--pod", "victim", "--scan",
                              "--json", "--valkey-url", valkey_url], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["fields_removed"] == 3
        assert owners() == [[p for p in pods if p != "victim"] for pods in before]
        assert b.canary.info().blocks == canary_blocks
        victim.seq = 4
        victim.publish_and_wait(b.proc)  # seq 3 was refused: a gap, which a --bind socket cannot replay
        info = victim.info()
        assert info.blocks == 1 and info.incomplete, info
        assert list(b.loop.run_until_complete(held_blocks(b.ix.writer, "victim"))) == [(500_004, "gpu", 0)]
        b.canary.publish_and_wait(b.proc)
        assert "Traceback" not in b.log.read_text()


def test_an_engine_restart_found_on_a_pod_whose_state_log_does_not_read_flags_it(valkey_url, tmp_path):
    """The junk found as an engine restart is cleared: a batch whose seq went back (not to 0) with a newer
    timestamp is answered "restart", the writer forgets the pod, and the reset that follows (``ResetIfThenCheck``:
    clear it if its seq is still the last) loads its log again. PodLogError left that reset and ended the process;
    now the batch fails alone (logged, counted) and the pod is flagged with the reason; other pods go on."""
    with bound_ingester(valkey_url, tmp_path) as b:
        victim = Canary(b.pub, b.ix, b.loop, pod="victim")
        for _ in range(3):
            victim.publish_and_wait(b.proc)  # seq 0..2, the pod loaded by the ingester
        # junk in the log alone (its generation kept): the batch is planned from what the ingester holds, and the
        # script's seq check answers it
        b.loop.run_until_complete(b.ix.client.hset(pod_state_key("victim"), "s", b"\xc1junk"))
        errors = metric(httpx.get(b.metrics_url, timeout=5).text, "kvpf_ingest_apply_errors_total")
        deadline = time.monotonic() + 15
        while not (info := victim.info()).incomplete:
            victim.pub.send_multipart(encode_frames("kv@victim@tiny", 1, victim.batch(1)))  # seq 1 again, newer ts
            time.sleep(0.3)
            assert b.proc.poll() is None, "the ingester died: " + b.log.read_text()[-2000:]
            assert time.monotonic() < deadline, (info, b.log.read_text()[-1500:])
        assert "state log does not read" in info.incomplete_reason, info
        assert info.seqs == {"0": 2}  # nothing cleared, nothing applied
        b.canary.publish_and_wait(b.proc)
        text = b.log.read_text()
        assert "engine restarted" in text and "state log does not read" in text and "Traceback" not in text
        assert metric(httpx.get(b.metrics_url, timeout=5).text, "kvpf_ingest_apply_errors_total") > errors
