"""Socket options of the ingester: source specs (pods=, curve_server_key=), CURVE key files, limits."""
from __future__ import annotations

import pytest
import zmq
import zmq.auth

from kv_preflight.ingester.curve import load_allowed_keys, load_keypair, z85_key
from kv_preflight.ingester.sources import Limits, Source, parse_source, secure_sources
from kv_preflight.config import Config
from kv_preflight.events import Topic


def test_pods_and_curve_server_key_options():
    public, _ = zmq.curve_keypair()
    src = parse_source(f"tcp://e:5557,replay=tcp://e:5558,pods=vllm-0@vllm-1,curve_server_key={public.decode()}")
    assert src == Source("tcp://e:5557", replay="tcp://e:5558", pods=frozenset({"vllm-0", "vllm-1"}),
                         curve_server_key=public)
    assert parse_source("tcp://*:5557,pods=sim-0", bind=True).pods == frozenset({"sim-0"})
    assert parse_source("tcp://e:5557").pods is None  # no option: every pod


def test_pod_model_and_engine_options_name_a_publisher_without_a_topic():
    src = parse_source("tcp://e:5557,replay=tcp://e:5558,pod=sgl-0,model=m@v1,engine=sglang")
    assert (src.engine, src.pod, src.model, src.replay) == ("sglang", "sgl-0", "m@v1", "tcp://e:5558")
    assert src.named_topic == Topic("sgl-0", "m@v1")
    bound = parse_source("tcp://*:5557,pod=trt-0,model=m,engine=trtllm", bind=True)
    assert bound.bind and bound.named_topic == Topic("trt-0", "m") and bound.engine == "trtllm"
    plain = parse_source("tcp://e:5557")
    assert plain.engine == "vllm" and plain.named_topic is None


@pytest.mark.parametrize("spec, bind, message", [
    ("tcp://e:1,pods=a@@b", False, "no empty name"),
    ("tcp://e:1,pods=", False, "no empty name"),
    ("tcp://e:1,curve_server_key=short", False, "z85"),
    ("tcp://*:1,curve_server_key=" + "0" * 40, True, "for --source"),
    ("tcp://e:1,pod=a", False, "pod= and model= go together"),  # pod= alone is refused
    ("tcp://e:1,model=m", False, "pod= and model= go together"),
    ("tcp://e:1,pod=a@b,model=m", False, "may not contain"),
    ("tcp://e:1,pod=a,model=m,pods=a", False, "redundant"),
    ("tcp://e:1,engine=tgi", False, "not one of sglang, trtllm, vllm"),
    ("tcp://e:1,podz=a", False, "is not replay="),
    ("tcp://e:1,replay=http://x", False, "is not replay="),
])
def test_bad_source_options_are_refused(spec, bind, message):
    with pytest.raises(ValueError, match=message):
        parse_source(spec, bind=bind)


def test_key_files_certificates_and_bare_z85(tmp_path):
    public_file, secret_file = zmq.auth.create_certificates(tmp_path, "ingester")
    public, secret = zmq.auth.load_certificate(secret_file)
    assert load_keypair(secret_file) == (public, secret)
    bare = tmp_path / "bare.secret"
    bare.write_text(secret.decode() + "\n")
    assert load_keypair(str(bare)) == (public, secret)
    with pytest.raises(ValueError):
        load_keypair(public_file)  # a public certificate holds no secret key

    allow = tmp_path / "allow"
    allow.mkdir()
    a_pub, _ = zmq.auth.create_certificates(allow, "engine-a")
    b_pub, _ = zmq.auth.create_certificates(allow, "engine-b")
    (allow / "README").write_text("not a key file, ignored")
    a, b = zmq.auth.load_certificate(a_pub)[0], zmq.auth.load_certificate(b_pub)[0]
    assert load_allowed_keys(str(allow)) == {a, b}
    assert load_allowed_keys(a_pub) == {a}
    listing = tmp_path / "keys.txt"
    listing.write_text(f"# engines\n{a.decode()}  # engine-a\n\n{b.decode()}\n")
    assert load_allowed_keys(str(listing)) == {a, b}
    listing.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no public key"):
        load_allowed_keys(str(listing))
    with pytest.raises(ValueError, match="z85"):
        z85_key("~" * 40, "k")  # "~" is not in the z85 alphabet
    with pytest.raises(ValueError, match="z85"):
        z85_key("a" * 39, "k")


def test_secure_sources_applies_limits_and_refuses_open_curve(tmp_path):
    _, secret_file = zmq.auth.create_certificates(tmp_path, "ingester")
    pub_file, _ = zmq.auth.create_certificates(tmp_path, "engine")
    bound, connecting = parse_source("tcp://*:1,pods=a", bind=True), parse_source("tcp://e:2")
    cfg = Config(max_frame_bytes=1 << 20, max_queue_bytes=64 << 20, curve_secret_key_file=secret_file,
                 curve_allow=pub_file)
    out = secure_sources([bound, connecting], cfg)
    assert all(s.limits == Limits(1 << 20, 64 << 20) and s.limits.rcvhwm == 64 for s in out)
    assert out[0].curve is not None and out[0].curve.allowed == {zmq.auth.load_certificate(pub_file)[0]}
    assert out[0].pods == {"a"} and out[1].curve is None  # the engine at e:2 is no CURVE server
    with pytest.raises(ValueError, match="needs --curve-allow"):
        secure_sources([bound], Config(curve_secret_key_file=secret_file))
    with pytest.raises(ValueError, match="needs --curve-secret-key-file"):
        secure_sources([bound], Config(curve_allow=pub_file))
    # a CURVE engine reached without our own key file: an ephemeral client keypair
    server_key = zmq.auth.load_certificate(pub_file)[0]
    [client] = secure_sources([parse_source(f"tcp://e:2,curve_server_key={server_key.decode()}")], Config())
    assert client.curve is not None and client.curve_server_key == server_key


def test_limits_and_config():
    assert Limits().max_frame_bytes == 32 << 20 and Limits().rcvhwm == 8
    assert Limits(max_frame_bytes=1 << 30, max_queue_bytes=1 << 20).rcvhwm == 1
    with pytest.raises(ValueError):
        Config(max_frame_bytes=100).validate()
    with pytest.raises(ValueError):
        Config(max_frame_bytes=1 << 20, max_queue_bytes=1 << 10).validate()
    with pytest.raises(ValueError, match="needs --curve-secret-key-file"):
        Config(curve_allow="/keys").validate()


def test_limits_from_env(monkeypatch):
    monkeypatch.setenv("KVPF_MAX_FRAME_BYTES", str(1 << 20))
    monkeypatch.setenv("KVPF_MAX_QUEUE_BYTES", str(16 << 20))
    cfg = Config.load()
    assert (cfg.max_frame_bytes, cfg.max_queue_bytes) == (1 << 20, 16 << 20)
    assert Config.load(max_frame_bytes=2 << 20).max_frame_bytes == 2 << 20  # the flag wins


def test_discovery_maps_every_endpoint_form_vllm_accepts():
    """vLLM 0.32 binds '*', '::' and ipc/inproc endpoints and connects to the rest; ipc:/// and
    tcp://[::] used to come out as '*ipc:///...' and 'tcp://[*]:...' (Protocol not supported)."""
    from kv_preflight.engines import engine
    from kv_preflight.ingester.discovery import sources_from

    def one(endpoint, replay="tcp://*:5558", url="http://vllm-0:8000"):
        body = {"0": {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
                      "topic": "kv@p@m"}}
        got = sources_from(engine("vllm"), url, body)
        return [(s.endpoint, s.bind, s.replay) for s in got]

    assert one("tcp://*:5557") == [("tcp://vllm-0:5557", False, "tcp://vllm-0:5558")]
    assert one("tcp://[::]:5557", "tcp://[::]:5558") == [("tcp://vllm-0:5557", False, "tcp://vllm-0:5558")]
    assert one("tcp://[::]:5557", url="http://[fd00::7]:8000") == [("tcp://[fd00::7]:5557", False, "tcp://[fd00::7]:5558")]
    assert one("ipc:///tmp/kv.sock", "ipc:///tmp/replay.sock") == [("ipc:///tmp/kv.sock", False, "ipc:///tmp/replay.sock")]
    assert one("tcp://10.0.0.5:5557") == [("tcp://*:5557", True, "tcp://vllm-0:5558")]  # the engine connects
    # any "::" makes vLLM bind (even a full IPv6 address): connect to that address
    assert one("tcp://[fd00::1]:5557") == [("tcp://[fd00::1]:5557", False, "tcp://vllm-0:5558")]
    assert one("tcp://0.0.0.0:5557") == [("tcp://*:5557", True, "tcp://vllm-0:5558")]  # vLLM connects to 0.0.0.0
    assert one("inproc://kv") == []  # not reachable from another process
