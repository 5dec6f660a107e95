"""`kv-preflight up` takes serve's routing and tokenizer options under serve's own names and hands them
to the predictor it starts unchanged."""
from __future__ import annotations

import click
import pytest

from kv_preflight.cli.main import cli, serve
from kv_preflight.cli.up import SERVE_OPTIONS, serve_args, up


def serve_option(name: str) -> click.Option:
    return next(p for p in serve.params if p.name == name)


def test_every_routing_and_tokenizer_option_of_serve_is_an_option_of_up():
    wanted = {p.name for p in serve.params if p.name.startswith(("route_", "tier_weights", "tokenizer", "pod_metrics",
                                                                   "metrics_interval", "ttft_model"))}
    assert wanted and wanted <= {p.name for p in up.params}


@pytest.mark.parametrize("opt", SERVE_OPTIONS, ids=lambda o: o.name)
def test_same_flag_names_and_kinds_as_serve(opt):
    theirs = serve_option(opt.name)
    assert (opt.opts, opt.secondary_opts, opt.multiple, opt.is_flag) == \
           (theirs.opts, theirs.secondary_opts, theirs.multiple, theirs.is_flag)
    assert type(opt.type) is type(theirs.type)


def parse(command: click.Command, args: list[str]) -> dict:
    ctx = click.Context(cli, info_name="kv-preflight")
    return command.make_context(command.name, list(args), parent=ctx).params  # click consumes the list


def test_given_options_reach_serve_as_given(tmp_path):
    ttft = tmp_path / "ttft.json"
    ttft.write_text("{}")
    given = ["--ttft-model", str(ttft), "--tokenizer", "m=/tok/m", "--tokenizer", "n=/tok/n", "--no-tokenizer-check", "--pod-metrics",
             "p=http://h:1", "--metrics-interval", "0.5", "--route-tier-weight", "gpu=1", "--route-tier-weight",
             "cpu=0.5", "--route-waiting-weight", "3", "--route-overload-abs", "5", "--route-overload-rel", "2",
             "--route-max-kv-usage", "0.9", "--route-good-match", "0.7", "--route-stale", "7"]
    direct = parse(serve, given)
    through_up = parse(serve, serve_args(parse(up, given)))
    names = [o.name for o in SERVE_OPTIONS]
    assert {n: through_up[n] for n in names} == {n: direct[n] for n in names}
    assert direct["tokenizer_check"] is False and direct["route_good_match"] == 0.7


def test_options_not_given_are_left_to_serve():
    assert serve_args(parse(up, [])) == []
    assert serve_args(parse(up, ["--tokenizer-check"])) == ["--tokenizer-check"]


def _kernel_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _draws(monkeypatch, *ports: int) -> None:
    """free_port's random draws, in order, made to be ``ports``."""
    from kv_preflight.cli import valkey_server

    class Draws:
        def __init__(self):
            self.left = list(ports)

        def randrange(self, lo, hi):
            return self.left.pop(0)

    draws = Draws()
    monkeypatch.setattr(valkey_server.random, "Random", lambda: draws)


def test_free_port_never_hands_out_a_port_twice_before_it_is_bound(monkeypatch):
    """Ports drawn together (``up``'s engine: HTTP, ZMQ, replay; a test's predictor and engine) are all
    unbound until their servers start: free_port must not give the same one twice meanwhile."""
    from kv_preflight.cli import valkey_server

    a, b = _kernel_port(), _kernel_port()
    _draws(monkeypatch, a, a, b)  # the same port twice, then another
    assert valkey_server.free_port() == a
    assert valkey_server.free_port() == b  # a drawn again, still unbound, is skipped


def test_a_reserved_port_is_never_handed_out(monkeypatch):
    """``up --port P``: P is free when checked and bound by the predictor last; the ports drawn meanwhile for
    valkey and the engines must not be P (CI: the predictor found its port taken, "Address already in use")."""
    from kv_preflight.cli import valkey_server

    a, b = _kernel_port(), _kernel_port()
    _draws(monkeypatch, a, b)
    valkey_server.reserve_port(a)
    assert valkey_server.free_port() == b
