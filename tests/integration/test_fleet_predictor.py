"""Zero-config predictors: a real ``serve --valkey-url URL`` process learns the fleet from
the records the ingesters write (``kvpf:fleet``, ``kvpf:load``, ``kvpf:settings``), here written by the
test through the same Index methods, beside real simulated engines and a real valkey-server."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.fleet.records import IndexSettings, PodLoad, PodRecord
from kv_preflight.index.index import StoreBlock
from kv_preflight.keys.chain import request_keys
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.leases import vouch
from tests.integration.sim import sim_engine
from tests.prom import metric

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

MODEL = "sim"  # what tests/integration/sim.py engines serve


def until(check: Callable[[], object], what: str, timeout_s: float = 20.0):
    """Wait for a state the predictor reaches on its own (the fleet is re-read every ~1 s); no timing asserted."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw: {what}")
        time.sleep(0.1)


class Serve:
    def __init__(self, valkey_url: str, tmp_path, *args: str):
        self.port = free_port()
        self.log = tmp_path / f"serve-{self.port}.log"
        self.proc = spawn(["serve", "--valkey-url", valkey_url, "--port", str(self.port), *args], str(self.log))
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> "Serve":
        wait_http(self.url + "/health")
        return self

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=10)

    def route(self, **body) -> httpx.Response:
        return self.post("/v1/cache/route", {"model": MODEL, **body})

    def stop(self) -> None:
        stop(self.proc)


@pytest.fixture
def serve(valkey_url, tmp_path):
    started: list[Serve] = []

    def make(*args: str) -> Serve:
        s = Serve(valkey_url, tmp_path, *args)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def sims(tmp_path):
    started = []

    def make(*pods: str):
        engines = [sim_engine(p, tmp_path).start() for p in pods]
        started.extend(engines)
        return engines

    yield make
    for e in started:
        e.stop(kill=True)


def record(engine, state: str = "live", models: Sequence[str] = (MODEL,)) -> PodRecord:
    return PodRecord(state=state, engine_url=engine.url, models=list(models), block_size=16, owner="test-ingester")


async def store(ix, pod: str, tokens: list[int], *, hash_seed: str = "", block_size: int = 16) -> None:
    """The pod holds these tokens' blocks (engine block = request-key block), keyed as a writer with these
    settings would."""
    mutations, parent = [], None
    field = ix.entry_field(pod, "GPU", None)
    for i in range(len(tokens) // block_size):
        rks = request_keys(tokens[i * block_size:(i + 1) * block_size], model=MODEL, hash_seed=hash_seed,
                           block_size=block_size, parent=parent)
        mutations.append(StoreBlock(rks[-1] ^ 0x5EED, "gpu", field, tuple(rks)))
        parent = rks[-1]
    result = await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=time.time(), model=MODEL,
                                  engine_block_size=block_size, mutations=mutations)
    assert result.status == "applied"


def candidates(d: dict) -> dict[str, dict]:
    return {c["pod_id"]: c for c in d["candidates"]}


async def test_serve_with_only_valkey_url_knows_routes_and_tokenizes_for_the_fleet(valkey_url, ix, sims, serve):
    a, b, c = sims("pod-a", "pod-b", "pod-c")
    prompt = list(range(100, 164))
    await store(ix, "pod-b", prompt)  # pod-b holds the prompt; the others are known only from the fleet records
    await vouch(ix, "pod-a", "pod-b", "pod-c")
    await ix.fleet.put_pod_records({"pod-a": record(a), "pod-b": record(b), "pod-c": record(c)})
    s = serve().ready()

    def seen_all():
        d = s.route(token_ids=prompt).json()
        return d if set(candidates(d)) == {"pod-a", "pod-b", "pod-c"} else None

    d = await asyncio.to_thread(until, seen_all, "every pod of kvpf:fleet as a route candidate")
    assert (d["pod_id"], d["reason"]) == ("pod-b", "best_overlap")
    # a prompt is tokenized by an engine of the model found in the fleet records (no --engine-url given)
    r = s.route(prompt="hello fleet")
    assert r.status_code == 200, r.text
    assert r.json()["total_prompt_tokens"] > 0
    # and prompts with no overlap spread over the fleet (no load known anywhere: by prefix hash)
    chosen = {s.route(token_ids=list(range(k * 1000, k * 1000 + 40))).json()["pod_id"] for k in range(1, 40)}
    assert chosen == {"pod-a", "pod-b", "pod-c"}
    fleet = httpx.get(s.url + "/stats").json()["fleet"]
    assert set(fleet["pods"]) == {"pod-a", "pod-b", "pod-c"} and fleet["error"] is None


async def test_retired_and_unreachable_pods_are_not_offered(valkey_url, ix, sims, serve):
    a, b = sims("pod-a", "pod-b")
    prompt = list(range(300, 364))
    await store(ix, "pod-a", prompt)
    await store(ix, "ghost", prompt)  # a pod whose engine left: retired, its entries not cleared yet
    await vouch(ix, "pod-a", "pod-b", "ghost")
    await ix.fleet.put_pod_records({"pod-a": record(a), "pod-b": record(b),
                              "ghost": PodRecord(state="live", engine_url="http://127.0.0.1:9", models=[MODEL])})
    s = serve().ready()
    await asyncio.to_thread(until, lambda: "ghost" in candidates(s.route(token_ids=prompt).json()), "ghost offered")
    await ix.fleet.put_pod_records({"ghost": PodRecord(state="retired", reason="left discovery", models=[MODEL])})

    def ghost_gone():
        d = s.route(token_ids=prompt).json()
        return d if "ghost" not in candidates(d) else None

    d = await asyncio.to_thread(until, ghost_gone, "the retired pod no longer offered")
    assert d["pod_id"] == "pod-a" and set(candidates(d)) == {"pod-a", "pod-b"}
    p = s.post("/v1/cache/predict", {"model": MODEL, "token_ids": prompt}).json()
    assert [x["pod_id"] for x in p["pod_affinities"]] == ["pod-a"]
    r = s.route(token_ids=prompt, pods=["ghost", "pod-a"])
    assert r.status_code == 400 and "retired pods: 'ghost'" in r.json()["error"]
    # an unknown pod in the filter is an error naming it, never the answer
    r = s.route(token_ids=prompt, pods=["nope"])
    assert r.status_code == 400 and "unknown pods" in r.json()["error"] and "'nope'" in r.json()["error"]
    assert s.route(token_ids=prompt, pods=["pod-b"]).json()["pod_id"] == "pod-b"
    # an unreachable pod keeps its entries (it may come back) but is not routed to
    await ix.fleet.put_pod_records({"pod-a": record(a, state="unreachable")})

    def a_out():
        d = s.route(token_ids=prompt).json()
        return d if d["pod_id"] == "pod-b" else None

    d = await asyncio.to_thread(until, a_out, "the unreachable pod not routed to")
    assert set(candidates(d)) == {"pod-b"}


async def test_load_from_kvpf_load_is_used_with_its_age(valkey_url, ix, sims, serve):
    a, b = sims("pod-a", "pod-b")
    prompt = list(range(500, 564))
    await store(ix, "pod-a", prompt)
    await store(ix, "pod-b", prompt[:32])
    await vouch(ix, "pod-a", "pod-b")
    await ix.fleet.put_pod_records({"pod-a": record(a), "pod-b": record(b)})
    now = await ix.fleet.now_ms()
    await ix.fleet.put_load({"pod-a": PodLoad(running=12, waiting=2, kv_usage=0.5, at_ms=now),
                       "pod-b": PodLoad(running=1, waiting=0, kv_usage=0.1, at_ms=now)})
    s = serve().ready()

    def loaded():
        d = s.route(token_ids=prompt).json()
        return d if candidates(d).get("pod-a", {}).get("load") == 16 else None

    d = await asyncio.to_thread(until, loaded, "pod-a's load from kvpf:load")
    assert candidates(d)["pod-a"]["overloaded"] and candidates(d)["pod-b"]["running"] == 1
    assert (d["pod_id"], d["reason"]) == ("pod-b", "least_loaded_good_match")
    # a scrape older than --route-stale (5 s) is unknown: assumed at the known pods' mean, never overloaded
    await ix.fleet.put_load({"pod-a": PodLoad(running=12, waiting=2, kv_usage=0.5, at_ms=await ix.fleet.now_ms() - 60_000)})

    def stale():
        d = s.route(token_ids=prompt).json()
        return d if candidates(d)["pod-a"].get("load") is None else None

    d = await asyncio.to_thread(until, stale, "pod-a's stale load treated as unknown")
    assert candidates(d)["pod-a"]["assumed_load"] == 1 and (d["pod_id"], d["reason"]) == ("pod-a", "best_overlap")


async def test_tokenization_fails_over_between_engine_urls_of_a_model(valkey_url, sims, serve):
    a, b = sims("pod-a", "pod-b")
    s = serve("--engine-url", f"{MODEL}={a.url}", "--engine-url", f"{MODEL}={b.url}").ready()
    r = s.post("/v1/cache/predict", {"model": MODEL, "prompt": "failover"})
    assert r.status_code == 200, r.text
    tokens = r.json()["total_prompt_tokens"]
    # both engines are scraped
    both = await asyncio.to_thread(
        until, lambda: {p for p, v in httpx.get(s.url + "/stats").json()["engine_load"].items()
                        if v["running"] is not None} == {"pod-a", "pod-b"} or None, "both engines scraped")
    assert both
    a.stop(kill=True)
    for _ in range(3):
        r = s.post("/v1/cache/predict", {"model": MODEL, "prompt": "failover"})
        assert r.status_code == 200, r.text
        assert r.json()["total_prompt_tokens"] == tokens
    # counted: the first prompt after the kill failed over to pod-b, which answers first from then on; and the
    # scrapes of pod-a's engine, which refuses connections now, fail
    assert metric(httpx.get(s.url + "/metrics").text, "kvpf_tokenize_failovers_total") == 1
    await asyncio.to_thread(until, lambda: metric(httpx.get(s.url + "/metrics").text,
                                                  "kvpf_engine_scrape_errors_total") > 0, "pod-a's scrapes counted")
    b.stop(kill=True)
    r = s.post("/v1/cache/predict", {"model": MODEL, "prompt": "failover"})
    assert r.status_code == 503 and "all 2 engines" in r.json()["error"]
    assert metric(httpx.get(s.url + "/metrics").text, "kvpf_tokenize_failovers_total") == 2


async def test_settings_are_adopted_or_a_disagreement_refused(valkey_url, ix, serve, tmp_path):
    await ix.fleet.claim_settings(IndexSettings(hash_seed="fleet-seed", block_size=32))
    prompt = list(range(700, 764))
    await store(ix, "pod-a", prompt, hash_seed="fleet-seed", block_size=32)
    # given settings that disagree: one clear line naming each, a non-zero exit, no traceback
    bad = serve("--hash-seed", "other", "--block-size", "16")
    assert bad.proc.wait(timeout=60) != 0
    out = bad.log.read_text()
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if "disagree" in line]
    assert len(lines) == 1, out
    assert "hash_seed: given 'other'" in lines[0] and "'fleet-seed'" in lines[0]
    assert "block_size: given 16" in lines[0] and "has 32" in lines[0]
    # agreeing given values and defaults: the rest adopted, and the index's keys found
    s = serve("--block-size", "32").ready()
    p = s.post("/v1/cache/predict", {"model": MODEL, "token_ids": prompt}).json()
    assert p["best_pod"] == "pod-a" and p["predicted_cached_tokens"] >= 32, p
    assert "adopted the index's settings: hash_seed='fleet-seed'" in s.log.read_text()


async def test_new_prefixes_are_placed_by_room_and_a_pending_one_follows_its_first_request(valkey_url, ix, sims,
                                                                                           serve):
    """A real ``serve --valkey-url`` over four pods: prefixes nobody holds fill the pods evenly (by the blocks of
    other recent prefixes placed on each, docs/routing.md), and a new prefix's next request, before the index
    shows it, goes where its first one went even once that pod reads busier than the rest."""
    engines = sims("pod-a", "pod-b", "pod-c", "pod-d")
    pods = [e.pod for e in engines]
    await ix.fleet.put_pod_records({e.pod: record(e) for e in engines})

    async def loads(busy: str | None = None) -> None:
        now = await ix.fleet.now_ms()
        await ix.fleet.put_load({p: PodLoad(running=3 if p == busy else 0, waiting=0, kv_usage=0.1, at_ms=now) for p in pods})

    await loads()
    # pending for 60 s: the wait below for a load scrape is not timed; loads this test writes once stay fresh for
    # 10 minutes (on a loaded machine the default 5 s passed before the last route, and its load read as unknown)
    s = serve("--route-pending", "60", "--route-stale", "600").ready()
    await asyncio.to_thread(until, lambda: all(c.get("load") == 0 for c in s.route(token_ids=[1] * 40).json()
                                               ["candidates"]) and len(s.route(token_ids=[1] * 40).json()
                                                                       ["candidates"]) == 4, "every pod's load")
    # eight new prefixes (64 tokens each), one at a time, loads equal: two per pod
    placed = [s.route(token_ids=list(range(k * 1000, k * 1000 + 64))).json() for k in range(10, 18)]
    assert {d["reason"] for d in placed} == {"no_overlap"}
    assert sorted(Counter(d["pod_id"] for d in placed).values()) == [2, 2, 2, 2]
    # a new prefix's first request; then its pod reads busier (3 running, the others idle: not overloaded)
    first = s.route(token_ids=list(range(90_000, 90_064))).json()
    await loads(busy=first["pod_id"])
    probe = list(range(80_000, 80_064))
    await asyncio.to_thread(until, lambda: candidates(s.route(token_ids=probe).json())[first["pod_id"]]["load"] == 3,
                            "the busier load read")
    again = s.route(token_ids=list(range(90_000, 90_064))).json()  # nothing stored: the index does not show it
    assert (again["pod_id"], again["reason"]) == (first["pod_id"], "no_overlap") and "pending" in again["detail"]
