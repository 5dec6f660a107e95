"""Send a workload to an engine, predicting just before each request, and compare with what the
engine then reports as ``usage.prompt_tokens_details.cached_tokens``.

Used by ``kv-preflight accuracy`` (a workload file), ``kv-preflight demo`` (a built-in one) and the
end-to-end tests. Between requests it waits until the index has applied every KV-event batch the
engine published: it subscribes to the engine's events itself (found via ``/kv_event_sources``) and
reads the pod's applied seq from the predictor's ``/stats``, so no sleep decides correctness.
"""
from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import zmq

import msgspec

from kv_preflight.jsonl import read_json_lines
from kv_preflight.events import topic_or_none
from kv_preflight.index.rank_pods import rank_pod


class EventWatcher:
    """An independent SUB on the engine's PUB sockets (one per data-parallel rank): the newest seq each index pod
    has published (a rank r >= 1 of pod P is the index pod ``P@dp<r>``, kv_preflight/index/rank_pods.py)."""

    def __init__(self, endpoint: str | list[str]):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        for ep in [endpoint] if isinstance(endpoint, str) else endpoint:
            self.sock.connect(ep)
        self.last_seq: dict[str, int] = {}

    @classmethod
    def for_engine(cls, engine_url: str, timeout_s: float = 5.0) -> "EventWatcher | None":
        """None when the engine publishes no events we can subscribe to (then we settle by quiet time)."""
        try:
            body = httpx.get(engine_url.rstrip("/") + "/kv_event_sources", timeout=timeout_s).json()
            endpoints = [body[rank]["endpoint"] for rank in sorted(body)]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None
        if not endpoints or any(not isinstance(e, str) or "*" not in e for e in endpoints):
            return None  # the engine connects to its subscribers: we cannot join
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        return cls([e.replace("*", host, 1) for e in endpoints])

    def drain(self, quiet_s: float = 0.25, max_s: float = 10.0) -> None:
        """Read until the engine has published nothing for ``quiet_s``."""
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            if not self.sock.poll(int(quiet_s * 1000)):
                return
            frames = self.sock.recv_multipart()
            if len(frames) == 3 and len(frames[1]) == 8:
                topic = topic_or_none(frames[0])
                pod = rank_pod(topic.pod_id if topic is not None else "", _rank_of(frames[2]))
                self.last_seq[pod] = int.from_bytes(frames[1], "big", signed=True)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _rank_of(payload: bytes) -> int:
    """The data-parallel rank a batch payload names (``[ts, events, rank]``), 0 when it names none."""
    try:
        batch = msgspec.msgpack.decode(payload)
        rank = batch[2] if isinstance(batch, list) and len(batch) > 2 else 0
        return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 else 0
    except (msgspec.DecodeError, TypeError):
        return 0


def applied_seqs(predictor_url: str) -> tuple[dict[str, int], set[str]]:
    """Each pod's last applied seq, and the pods with changes still to run on other shards (``pending_effects``:
    on a Valkey Cluster a batch's seq is written with its pod's state before its changes run there)."""
    stats = httpx.get(predictor_url.rstrip("/") + "/stats", timeout=5).json()
    pods = stats.get("pods", [])
    return ({p["pod_id"]: max((p.get("last_seq") or {"0": -1}).values()) for p in pods},
            {p["pod_id"] for p in pods if p.get("pending_effects")})


# After a batch's seq, how long to wait for its changes on the other shards: they run in the same round, within
# milliseconds; an entry left by a failover is run again later (at the pod's next batch, or by the chores of
# a stale entry), which a quiet engine would wait for in vain.
EFFECTS_SETTLE_S = 2.0


def wait_caught_up(predictor_url: str, watcher: EventWatcher | None, timeout_s: float = 20.0) -> None:
    if watcher is None:
        time.sleep(0.5)
        return
    watcher.drain()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen, pending = applied_seqs(predictor_url)
        if all(seen.get(pod, -1) >= seq for pod, seq in watcher.last_seq.items()):
            settle = time.monotonic() + EFFECTS_SETTLE_S
            while pending & set(watcher.last_seq) and time.monotonic() < settle:
                time.sleep(0.02)
                pending = applied_seqs(predictor_url)[1]
            return
        time.sleep(0.02)
    raise TimeoutError(f"the index did not reach the engine's seqs {watcher.last_seq} in {timeout_s}s")


@dataclass
class Outcome:
    index: int
    prompt_tokens: int
    predicted: int
    actual: int
    best_pod: str | None

    @property
    def exact(self) -> bool:
        return self.predicted == self.actual


class WorkloadError(Exception):
    """An engine or the predictor refused a request of the workload; the message is theirs, in one line."""


def answer_message(r: httpx.Response) -> str:
    """The error message of an HTTP answer (vLLM: {"error": {"message"}}, Starlette: {"detail"}), one line."""
    try:
        body = r.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        text = (err.get("message") or err.get("detail") or err.get("error")) if isinstance(err, dict) else err
    except ValueError:
        text = r.text
    return " ".join(str(text or r.reason_phrase).split())[:500]


def _send(client: httpx.Client, engine_url: str, model: str, req: dict) -> tuple[int, int]:
    if "messages" in req:
        body, path = {"model": model, "messages": req["messages"], "max_tokens": 1}, "/v1/chat/completions"
    else:
        body, path = {"model": model, "prompt": req.get("token_ids", req.get("prompt")), "max_tokens": 1}, "/v1/completions"
    # Passed to the engine as given: vLLM's per-request extras (e.g. kv_cache_report_mode) and cache_salt.
    body.update({k: req[k] for k in ("vllm_xargs", "cache_salt") if k in req})
    # a data-parallel engine: the request pinned to the rank the workload names (vLLM's header)
    headers = {DP_RANK_HEADER: str(req["dp_rank"])} if req.get("dp_rank") is not None else None
    r = client.post(engine_url.rstrip("/") + path, json=body, headers=headers, timeout=120)
    if r.status_code != 200:
        raise WorkloadError(f"the engine answered {r.status_code}: {answer_message(r)}")
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def pod_of(engine_url: str) -> str | None:
    try:
        body = httpx.get(engine_url.rstrip("/") + "/kv_event_sources", timeout=5).json()
        return topic_or_none(body[sorted(body)[0]]["topic"]).pod_id
    except Exception:
        return None


def run_workload(engine_url: str, predictor_url: str, model: str, requests: Iterable[dict], *,
                 on_result=None) -> list[Outcome]:
    """Predict (restricted to this engine's pod), send, compare, for each request in order."""
    watcher = EventWatcher.for_engine(engine_url)
    pod = pod_of(engine_url)
    out: list[Outcome] = []
    try:
        with httpx.Client() as client:
            for i, req in enumerate(requests):
                wait_caught_up(predictor_url, watcher)
                body = {"model": model, **{k: v for k, v in req.items() if k in ("token_ids", "prompt", "messages")}}
                if pod:
                    body["pods"] = [pod]
                p = client.post(predictor_url.rstrip("/") + "/v1/cache/predict", json=body, timeout=30)
                if p.status_code != 200:
                    raise WorkloadError(f"request {i}: the predictor answered {p.status_code}: {answer_message(p)}")
                pred = p.json()
                n, actual = _send(client, engine_url, model, req)
                predicted = pred["predicted_cached_tokens"]
                if req.get("dp_rank") is not None:  # pinned to a rank: what that rank's cache holds
                    predicted = next((a["cached_tokens"] for a in pred["pod_affinities"]
                                      if a.get("dp_rank", 0) == req["dp_rank"]), 0)
                res = Outcome(i, n, predicted, actual, pred.get("best_pod"))
                out.append(res)
                if on_result:
                    on_result(res)
    finally:
        if watcher:
            watcher.close()
    return out


DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM 0.32: pins a request to a data-parallel rank


def load_workload(path: Path) -> list[dict]:
    """JSON lines, each with one of token_ids, prompt, messages (and optionally ``dp_rank``: the request is
    pinned to that data-parallel rank, and compared with what that rank's cache holds)."""
    reqs = []
    for n, obj in read_json_lines(path):
        if not isinstance(obj, dict) or sum(k in obj for k in ("token_ids", "prompt", "messages")) != 1:
            raise ValueError(f"{path}:{n}: needs exactly one of token_ids, prompt, messages")
        reqs.append(obj)
    return reqs


def shared_prefix_workload(n: int = 12, seed: int = 3, vocab: int = 8000, block: int = 32) -> list[dict]:
    """A short demo: two system prompts, several documents, follow-up questions; as token ids."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, vocab) for _ in range(block * 3 + 5)] for _ in range(2)]
    docs = [[rng.randrange(10, vocab) for _ in range(block * 2 + 11)] for _ in range(3)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(10, vocab) for _ in range(rng.randrange(3, 30))]
        reqs.append({"token_ids": systems[i % 2] + docs[(i // 2) % 3] + tail})
    return reqs


def summarize(results: list[Outcome]) -> dict:
    exact = sum(r.exact for r in results)
    errors = [abs(r.predicted - r.actual) for r in results]
    return {
        "requests": len(results),
        "exact": exact,
        "exact_rate": round(exact / len(results), 4) if results else None,
        "mean_abs_error_tokens": round(sum(errors) / len(errors), 2) if errors else None,
        "max_abs_error_tokens": max(errors, default=0),
        "requests_with_hits": sum(r.actual > 0 for r in results),
    }
