"""The write-path bench's writers take turns (cli/bench/floor.py ``interleaved``): every writer gets every
measured frame once, in order, and no writer always goes first (each turn's order rotates)."""
from __future__ import annotations

import asyncio

from kv_preflight.cli.bench import floor


class Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.got = name, log, []

    async def write(self, frames: list) -> None:
        self.got.extend(frames)
        self.log.append(self.name)


def test_writers_take_turns_in_rotating_order(monkeypatch):
    monkeypatch.setattr(floor, "TURN_FRAMES", 2)
    log: list[str] = []
    writers = {n: (Recorder(n, log), []) for n in ("a", "b", "c")}
    warm, measured = [("p", [b"w"])], [("p", [bytes([i])]) for i in range(7)]
    out = asyncio.run(floor.interleaved(writers, warm, measured))
    for w, _ in writers.values():
        assert w.got == warm + measured
    turns = log[3:]  # after each writer's warm-up
    assert [turns[i:i + 3] for i in range(0, 12, 3)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                          ["a", "b", "c"]]
    assert set(out) == {"a", "b", "c"} and all(cpu == 0 for _, cpu, _ in out.values())
