"""Reading a shard's replicas from CLUSTER NODES (the replication barrier's topology, kv_preflight/index/cluster/barrier.py)."""
from kv_preflight.index.cluster.barrier import live_replicas

# Valkey 8's CLUSTER NODES, as a master answers it: one replica in sync, the other shards' nodes around it
TABLE = """\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383
6ec23923021cf3ffec47632106199cb7f496ce01 127.0.0.1:30005@31005 slave 67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 0 1426238316232 5 connected
824fe116063bc5fcf9f4ffd895bc17aee7731ac3 127.0.0.1:30006@31006 slave 292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 0 1426238317741 6 connected
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460
"""
ME = "e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca"


def test_counts_the_replicas_of_the_node_that_answered():
    assert live_replicas(TABLE) == 1


PONG = 1426238317239  # the replica's last pong in TABLE (ms)


def test_a_replica_failed_long_ago_is_not_waited_for_a_suspected_one_is():
    failed = TABLE.replace("30004@31004 slave", "30004@31004 slave,fail")
    suspected = TABLE.replace("30004@31004 slave", "30004@31004 slave,fail?")
    assert live_replicas(failed) == 0  # its last pong (2015) is long past
    assert live_replicas(failed, now_ms=PONG + 241_000) == 0
    assert live_replicas(suspected) == 1


def test_a_replica_failed_a_moment_ago_is_still_waited_for():
    """Marked failed (paused or cut off past the node timeout), it may be back and promoted before it has
    caught up: writes acknowledged without it would be lost with no outbox entry left to run them again."""
    failed = TABLE.replace("30004@31004 slave", "30004@31004 slave,fail")
    assert live_replicas(failed, now_ms=PONG + 3_000) == 1
    assert live_replicas(failed, now_ms=PONG + 239_000) == 1
    assert live_replicas(failed, now_ms=PONG + 3_000, grace_ms=2_000) == 0
    never = failed.replace(f" 0 {PONG} 4 connected", " 0 0 4 connected")  # no pong ever: not waited for
    assert live_replicas(never, now_ms=PONG) == 0


def test_no_replica_no_myself_and_a_replica_answering():
    alone = "\n".join(line for line in TABLE.splitlines() if ME not in line.split()[3:4])
    assert live_replicas(alone) == 0
    assert live_replicas(TABLE.replace("myself,", "")) == 0  # not this table's own node: nothing known
    as_replica = TABLE.replace("myself,master", "master").replace("30004@31004 slave", "30004@31004 myself,slave")
    assert live_replicas(as_replica) == 0  # a replica has no replicas of its own here
    assert live_replicas(TABLE.replace("slave", "replica")) == 1  # the newer flag name
    assert live_replicas("") == 0
