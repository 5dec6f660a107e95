"""Which event streams are silent past their usual gap (ingester/liveness.py), and what each socket sets."""
from __future__ import annotations

import zmq

from kv_preflight.ingester.liveness import StreamWatch
from kv_preflight.ingester.sources import Liveness


def test_a_stream_is_probed_once_silent_past_its_usual_gap_and_again_only_after_as_long():
    watch = StreamWatch(silence_s=10.0)
    assert not watch.due("tcp://e:1", 100.0)  # no frame yet: nothing to compare with
    for t in range(0, 60, 5):  # a frame every 5 s: its usual gap
        watch.frame("tcp://e:1", float(t))
    assert watch.threshold_s("tcp://e:1") == 20.0  # four times its gap, over the 10 s floor
    assert not watch.due("tcp://e:1", 70.0)
    assert watch.due("tcp://e:1", 76.0)
    assert not watch.due("tcp://e:1", 80.0)  # probed at 76: not again before another 20 s of silence
    assert watch.due("tcp://e:1", 96.5)
    watch.frame("tcp://e:1", 97.0)
    assert not watch.due("tcp://e:1", 100.0)
    assert StreamWatch(silence_s=0).threshold_s("tcp://e:1") is None  # off


def test_seqs_received_keep_the_highest_and_an_engine_restart_at_0():
    watch = StreamWatch(silence_s=10.0)
    for seq in (3, 5, 4):
        watch.batch("p", 0, seq)
    assert watch.received[("p", 0)] == 5
    watch.batch("p", 0, 0)  # a new engine process
    assert watch.received[("p", 0)] == 0


def test_every_socket_gets_heartbeats_and_keepalive_unless_turned_off():
    opts = dict(Liveness(heartbeat_s=2.0, heartbeat_timeout_s=6.0, keepalive_s=30.0).options())
    assert (opts[zmq.HEARTBEAT_IVL], opts[zmq.HEARTBEAT_TIMEOUT], opts[zmq.HEARTBEAT_TTL]) == (2000, 6000, 6000)
    assert opts[zmq.HANDSHAKE_IVL] == 6000
    assert (opts[zmq.TCP_KEEPALIVE], opts[zmq.TCP_KEEPALIVE_IDLE], opts[zmq.TCP_KEEPALIVE_INTVL]) == (1, 30, 10)
    assert Liveness(heartbeat_s=0, keepalive_s=0).options() == []
