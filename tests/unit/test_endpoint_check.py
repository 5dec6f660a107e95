"""``check_zmq_endpoint`` (engines/endpoints.py) against real libzmq sockets: whatever it accepts to connect
to, a socket connects to without an error (an error there used to end the ingester: issue 26, finding 1),
and what it refuses is what libzmq refuses or what no other process could reach."""
from __future__ import annotations

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.engines.endpoints import IPC_PATH_MAX, check_zmq_endpoint, endpoint_identity

PREFIXES = st.sampled_from(["tcp://", "tcp://127.0.0.1:", "tcp://[::1]:", "tcp://*:", "tcp://host-1.svc:", "ipc://",
                            "ipc:///tmp/", "inproc://", ""])
TAILS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=130)
ENDPOINTS = st.one_of(st.builds(lambda a, b: a + b, PREFIXES, TAILS),
                      st.builds(lambda p, s: f"tcp://127.0.0.1:{p}{s}", st.integers(-3, 70000),
                                st.sampled_from(["", "\n", " ", "\t", "x"])))


@settings(max_examples=400, deadline=None)
@given(endpoint=ENDPOINTS)
def test_what_is_accepted_a_socket_can_connect_to(endpoint):
    try:
        check_zmq_endpoint(endpoint, bind=False)
    except ValueError:
        return
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    try:
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)  # must not raise
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557\n", "tcp://127.0.0.1:5557 ", "tcp://127.0.0.1:0",
                                      "tcp://127.0.0.1:65536", "tcp://*:5557", "tcp://[::]:5557", "inproc://x",
                                      "ipc://", "ipc://@", "ipc:///tmp/" + "p" * IPC_PATH_MAX, "tcp://a b:1", "tcp://[zz]:1"])
def test_refused_to_connect(endpoint):
    with pytest.raises(ValueError):
        check_zmq_endpoint(endpoint, bind=False)


def test_a_wildcard_is_for_binding_only():
    assert check_zmq_endpoint("tcp://*:5557", bind=True) == "tcp://*:5557"
    assert check_zmq_endpoint("ipc:///tmp/" + "p" * (IPC_PATH_MAX - len("/tmp/")), bind=False)


def test_one_socket_spelled_many_ways_is_one_identity():
    same = {endpoint_identity(e) for e in ("tcp://127.0.0.1:5557", "tcp://127.3.2.1:5557", "tcp://localhost:5557",
                                           "tcp://[::1]:5557", "tcp://LOCALHOST:05557")}
    assert same == {"tcp://loopback:5557"}
    assert endpoint_identity("tcp://10.0.0.7:5557") != endpoint_identity("tcp://10.0.0.8:5557")
