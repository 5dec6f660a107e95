"""The property of issue 40: over a randomized (seeded) fault schedule, no answer says ``exact`` while it differs
from the engine. Real processes throughout: a valkey-server, a simulated engine (``kv-preflight simulate``: vLLM
0.32's cache rules and events), an ingester, a ``kv-preflight serve``.

The faults: the engine stopped (SIGTERM) or killed (SIGKILL) and restarted, the ingester killed (kill -9) and
restarted, the ingester frozen (SIGSTOP) then resumed, Valkey frozen then resumed, and the engine's cache reset
(AllBlocksCleared). Each episode is a fault, requests the engine serves meanwhile (blind: the index may not be
listening), a check, the recovery, a check. A check predicts a few probe prompts at once (``pods`` = the
engine's pod), then asks the engine itself: the cached tokens it reports when served each probe (the probes
share no block and the engine has room for all, so serving one changes none of the others), or none at all
while it is down. Every ``exact`` answer must equal that.

The index lags the engine by what is in flight, and a fault is seen only after the documented detection time,
so a check comes ``SETTLE_S`` after the engine's cache last changed (two lease renewals missed read ``behind``
2.5 s after the last renewal) and ``DEATH_S`` after the engine stopped (``--health-failures 2``, a health
check a second, the predictor's next read of the records). Within those bounds, before issue 40, a stopped
engine stayed ``exact`` until its retirement (60 s) and a frozen ingester's pods until its lease expired (12 s
here): the schedule always holds those two faults. ``KVPF_PROPERTY_SEED`` picks another schedule.
"""
from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.index.index import Index
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import sim_engine
from tests.integration.test_fleet import FAST_ENV
from tests.integration.truth import engine_truth, index_state
from tests.integration.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.anyio,
              pytest.mark.serial(reason="its checks wait the documented detection times: a loaded machine would "
                                        "stretch the detection past them")]

BLOCK = 16
SETTLE_S = 3.5  # two missed lease renewals (2.5 s after the last renewal) and a second of slack
DEATH_S = 6.0  # two failed health checks a second apart, the predictor's next read, and slack
INGEST = ["--lease-ttl", "12", "--membership-hold", "1", "--health-failures", "2"]
ALWAYS = ["engine_term", "ingester_stop"]  # items 2 and 9 of the issue: every schedule holds them
OTHERS = ["engine_kill", "ingester_kill", "valkey_stop", "clear"]


class Stack:
    def __init__(self, tmp_path, seed: int):
        self.tmp = tmp_path
        self.rng = random.Random(seed)
        self.valkey = ValkeyServer(tmp_path / "valkey", appendonly=True).start()
        self.engine = sim_engine("sim-prop", tmp_path, blocks=512).start()
        self.engine_up = True
        self.url = f"http://127.0.0.1:{free_port()}"
        self.pred = spawn(["serve", "--valkey-url", self.valkey.url, "--port", self.url.rsplit(":", 1)[1]],
                          str(tmp_path / "serve.log"))
        self.ingesters = 0
        self.ing = self.start_ingester()
        self.changed = time.monotonic()  # when the engine's cache last changed (a request, a reset, a death)
        self.checks: list[tuple[str, int, str, int, int]] = []  # (when, probe, state, predicted, engine's)
        self.violations: list[str] = []
        wait_http(self.url + "/health")

    def start_ingester(self):
        self.ingesters += 1
        return spawn(["ingest", "--valkey-url", self.valkey.url, "--engine", self.engine.url, *INGEST],
                     str(self.tmp / f"ing-{self.ingesters}.log"), env=FAST_ENV)

    def prompt(self, blocks: int | None = None) -> list[int]:
        return [self.rng.randrange(10, 30000) for _ in range(BLOCK * (blocks or self.rng.randrange(2, 6)) + 3)]

    def serve(self, prompts: list[list[int]]) -> list[int]:
        out = [self.engine.complete(p) for p in prompts]
        self.changed = time.monotonic()
        return out

    def settle(self, after_s: float = SETTLE_S) -> None:
        time.sleep(max(0.0, self.changed + after_s - time.monotonic()))

    def check(self, when: str, probes: list[list[int]]) -> None:
        """Predict every probe, then ask the engine; an exact answer must be the engine's."""
        answers = []
        with httpx.Client(timeout=15) as c:
            for p in probes:
                r = c.post(self.url + "/v1/cache/predict", json={"model": "sim", "token_ids": p,
                                                                "pods": [self.engine.pod]})
                assert r.status_code in (200, 503), r.text  # 503: Valkey frozen, no answer to judge
                answers.append(r.json() if r.status_code == 200 else None)
        truths = self.serve(probes) if self.engine_up else [0] * len(probes)
        for i, (a, truth) in enumerate(zip(answers, truths)):
            if a is None:
                continue
            state = a["freshness"]["state"]
            self.checks.append((when, i, state, a["predicted_cached_tokens"], truth))
            if state == "exact" and a["predicted_cached_tokens"] != truth:
                self.violations.append(f"{when}: probe {i} answered exact, {a['predicted_cached_tokens']} cached "
                                       f"on {a['best_pod']}, the engine held {truth}: {a['freshness']}")

    def close(self) -> None:
        for proc in (self.ing, self.pred):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            stop(proc)
        if self.valkey.proc is not None and self.valkey.proc.poll() is None:
            os.kill(self.valkey.proc.pid, signal.SIGCONT)
        self.engine.stop()
        self.valkey.stop()


def episode(s: Stack, fault: str, probes: list[list[int]]) -> None:
    """One fault: what the engine serves meanwhile (a new probe, served blind), a check once the fault had time
    to be seen, the recovery, a check. Every check serves every probe, so only what changed since differs."""
    if fault in ("engine_term", "engine_kill"):
        s.engine.stop(kill=fault == "engine_kill")
        s.engine_up, s.changed = False, time.monotonic()
        s.settle(DEATH_S)
        s.check(f"{fault}: down", probes)
        s.engine.start()  # same ports, a new process: an empty cache, seq from 0
        s.engine_up, s.changed = True, time.monotonic()
    elif fault in ("ingester_kill", "ingester_stop"):
        if fault == "ingester_kill":
            os.kill(s.ing.pid, signal.SIGKILL)
            s.ing.wait()
        else:
            os.kill(s.ing.pid, signal.SIGSTOP)
        probes.append(s.prompt(blocks=3))
        s.serve(probes[-1:])  # blind: nobody indexes it now
        s.settle()
        s.check(f"{fault}: down", probes)
        if fault == "ingester_kill":
            s.ing = s.start_ingester()
        else:
            os.kill(s.ing.pid, signal.SIGCONT)
    elif fault == "valkey_stop":
        os.kill(s.valkey.proc.pid, signal.SIGSTOP)
        probes.append(s.prompt(blocks=3))
        s.serve(probes[-1:])  # the ingester cannot write it now
        s.settle()
        s.check(f"{fault}: down", probes)
        os.kill(s.valkey.proc.pid, signal.SIGCONT)
    elif fault == "clear":
        s.engine.clear(s.prompt(1))
        s.changed = time.monotonic()
    s.settle()
    s.check(f"{fault}: after", probes)


async def test_no_answer_is_exact_while_it_differs_from_the_engine(tmp_path):
    seed = int(os.environ.get("KVPF_PROPERTY_SEED", "40"))
    rng = random.Random(seed)
    schedule = ALWAYS + rng.sample(OTHERS, 2)
    rng.shuffle(schedule)
    s = Stack(tmp_path, seed)
    ix = Index.from_url(s.valkey.url)
    try:
        probes = [s.prompt(blocks=3) for _ in range(3)]
        s.serve(probes[:2])  # two of three cached before the first fault

        async def exact_at_start():
            r = httpx.post(s.url + "/v1/cache/predict", json={"model": "sim", "token_ids": probes[0]}, timeout=10)
            return r.status_code == 200 and r.json()["freshness"]["state"] == "exact"

        await until(exact_at_start, "the first answers exact", timeout=30)
        for fault in schedule:
            episode(s, fault, probes)
        assert not s.violations, f"seed {seed}, schedule {schedule}:\n" + "\n".join(s.violations)
        assert any(state == "exact" for *_, state, _, _ in s.checks), s.checks  # it was not degraded throughout

        async def caught_up():  # the oracle at the end: the index holds what the engine's replay says it holds
            return await index_state(ix, s.engine.pod) == engine_truth(s.engine.published())

        await until(caught_up, "the index equal to the engine's replay")
    finally:
        await ix.close()
        s.close()
