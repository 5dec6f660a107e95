"""The ingester's recovery rules (pure) and which Valkey errors are worth a retry."""
from __future__ import annotations

from redis.exceptions import ConnectionError, OutOfMemoryError, ReadOnlyError, ResponseError, TimeoutError

from kv_preflight.ingester.recovery import Done, Force, Replay, Reset, ResetIfThenCheck, next_step
from kv_preflight.ingester.valkey_retry import transient


def step(status, mode="check", seq=5, last=2, can_replay=True, has_replay=True):
    return next_step(status, mode=mode, seq=seq, last_seq=last, can_replay=can_replay, has_replay=has_replay)


def test_terminal_statuses():
    for status in ("applied", "dup", "corrupt"):
        assert step(status) == Done(status)


def test_restart_at_zero_resets_past_zero_resets_if_then_checks():
    assert step("restart", seq=0) == Reset()
    assert step("restart", seq=7, last=9) == ResetIfThenCheck(9)
    assert step("restart", mode="reset", seq=0) == Done("restart")  # never reset twice


def test_gap_replays_once_then_forces():
    assert step("gap", seq=5, last=2) == Replay(3)
    forced = step("gap", seq=5, last=2, can_replay=False)
    assert isinstance(forced, Force) and "3..4" in forced.reason and "replay buffer" in forced.reason
    assert "no replay endpoint" in step("gap", can_replay=False, has_replay=False).reason


def test_every_chain_of_steps_is_short():
    """Whatever the script answers, a batch settles within a handful of steps (no recursion, no loop)."""
    import itertools

    from kv_preflight.ingester.recovery import MAX_STEPS
    for answers in itertools.product(("gap", "restart", "applied"), repeat=4):
        mode, can_replay, steps = "check", True, 0
        for status in answers:
            steps += 1
            s = next_step(status, mode=mode, seq=3, last_seq=1, can_replay=can_replay, has_replay=True)
            if isinstance(s, Done):
                break
            if isinstance(s, Reset):
                mode = "reset"
            elif isinstance(s, Replay):
                can_replay = False
            elif isinstance(s, Force):
                mode = "force"
        assert steps <= MAX_STEPS


def test_transient_errors():
    assert transient(ConnectionError("x")) and transient(TimeoutError("x")) and transient(OSError("x"))
    assert transient(OutOfMemoryError("command not allowed")) and transient(ReadOnlyError("x"))
    assert transient(ResponseError("BUSY Valkey is busy running a script"))
    assert transient(ResponseError("LOADING Valkey is loading the dataset in memory"))
    assert not transient(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert not transient(ResponseError("ERR Error running script: something"))
