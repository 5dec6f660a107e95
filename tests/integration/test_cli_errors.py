"""Bad input to the CLI is one clear error line and a non-zero exit, never a traceback or a silent
no-op (Operator experience, findings 4 and 5). The last test walks the click command tree, so a new
command or option is run with bad input without being listed here; a free-text option it cannot
make bad must be classified in FREE_TEXT."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kv_preflight.cli import stack_file
from kv_preflight.cli.env import walk
from kv_preflight.cli.main import cli
from kv_preflight.cli.valkey_server import free_port
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import sim_engine
from tests.integration.up_procs import reaped, stack_pids

pytestmark = pytest.mark.integration

DEAD_HTTP = f"http://127.0.0.1:{free_port()}"  # nothing listens there
DEAD_VALKEY = f"redis://127.0.0.1:{free_port()}/0"


def kvpf(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=timeout, **kw)


def error_lines(stderr: str) -> list[str]:
    """stderr without click's and argparse's usage lines: what the user reads as the error."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith(("Usage:", "usage:", "Try '", "  "))]


def assert_one_clear_line(out: subprocess.CompletedProcess, says: str | None = None) -> None:
    text = out.stdout + out.stderr
    assert out.returncode not in (0, None), text
    assert "Traceback" not in text, text
    lines = error_lines(out.stderr)
    assert len(lines) == 1, text
    if says:
        assert says in lines[0], text


async def _fill(valkey_url: str, pod: str, blocks: int) -> None:
    from kv_preflight.index.index import Index, StoreBlock, encode_entry, make_entry

    entry = encode_entry(make_entry(pod, "GPU", 0))
    ix = Index.from_url(valkey_url)
    try:
        for start in range(0, blocks, 500):
            await ix.apply_batch(pod_id=pod, rank=0, seq=start // 500, ts=1.0, model="m", engine_block_size=16,
                                 mutations=[StoreBlock(10_000 + i, "gpu", entry, (20_000 + i,))
                                            for i in range(start, min(blocks, start + 500))])
    finally:
        await ix.close()


def test_export_into_a_closed_pipe_exits_quietly(valkey_url):
    """`index export | head -2` printed "cannot reach Valkey: Broken pipe"."""
    asyncio.run(_fill(valkey_url, "pod-pipe", 4000))  # ~600 KB: far more than a pipe buffers
    proc = subprocess.Popen([sys.executable, "-m", "kv_preflight", "index", "export", "--valkey-url", valkey_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = [proc.stdout.readline(), proc.stdout.readline()]
    proc.stdout.close()  # what head does after its two lines
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1, err  # click's quiet exit on EPIPE, as every command
    assert json.loads(first[0])["pod"] == "pod-pipe" and json.loads(first[1])["pod"] == "pod-pipe"
    assert "Broken pipe" not in err and "cannot reach" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("args", [["clear", "--pod", "nope"], ["export", "--pod", "nope"],
                                  ["export", "--pod", "pod-known", "--pod", "nope"]])
def test_an_unknown_pod_is_an_error_naming_it(valkey_url, args):
    """`index clear|export --pod nope` exited 0 and did nothing (export wrote a header with an empty model)."""
    asyncio.run(_fill(valkey_url, "pod-known", 3))
    out = kvpf("index", *args, "--valkey-url", valkey_url)
    assert_one_clear_line(out, "unknown pod nope")
    assert "pod-known" in out.stderr and out.stdout == ""


def test_a_pod_whose_state_log_does_not_read_is_one_clear_error_and_changes_nothing(valkey_url):
    """`index export|clear|import --replace` of a pod whose state log holds junk (a hand edit, a bug, a build that
    writes another format) printed the decoder's traceback ("msgspec.DecodeError: MessagePack data is malformed"),
    and `clear --forget` left the pod refused by every ingester. Now each is one line naming the pod, nothing
    written: its entries cannot be found without its log."""
    import redis

    from kv_preflight.index.layout import FORGET_KEY, pod_state_key

    asyncio.run(_fill(valkey_url, "pod-junk", 3))
    exported = kvpf("index", "export", "--valkey-url", valkey_url).stdout
    asyncio.run(_fill(valkey_url, "pod-ok", 2))
    r = redis.Redis.from_url(valkey_url)
    r.hset(pod_state_key("pod-junk"), "s", b"\xc1junk")
    for args in (["export"], ["export", "--pod", "pod-junk"], ["clear", "--pod", "pod-junk"],
                 ["clear", "--pod", "pod-junk", "--forget"]):
        out = kvpf("index", *args, "--valkey-url", valkey_url)
        assert_one_clear_line(out, "pod pod-junk: its state log does not read")
        assert "`index clear --pod pod-junk --scan` clears them without it" in out.stderr  # the way out
    out = kvpf("index", "import", "--replace", "--valkey-url", valkey_url, input=exported)
    assert_one_clear_line(out, "pod pod-junk: its state log does not read")
    stats = json.loads(kvpf("index", "stats", "--valkey-url", valkey_url, "--json").stdout)
    assert {p["pod_id"]: p["blocks"] for p in stats["pods"]} == {"pod-junk": 3, "pod-ok": 2}
    assert not r.hgetall(FORGET_KEY)  # not let go: the ingesters still take its frames
    assert kvpf("index", "export", "--pod", "pod-ok", "--valkey-url", valkey_url).returncode == 0


def test_rebuild_of_an_unknown_pod_is_an_error_and_wipes_nothing(valkey_url, tmp_path):
    engine = sim_engine("sim-rb", tmp_path).start()
    try:
        asyncio.run(_fill(valkey_url, "sim-rb", 3))
        out = kvpf("index", "rebuild", "--valkey-url", valkey_url, "--engine", engine.url, "--pod", "nope")
        assert_one_clear_line(out, "unknown pod nope: the engines publish sim-rb")
        stats = json.loads(kvpf("index", "stats", "--valkey-url", valkey_url, "--json").stdout)
        assert [p["blocks"] for p in stats["pods"]] == [3]
    finally:
        engine.stop()


def test_bench_only_bogus_lists_the_valid_names():
    out = kvpf("bench", "--only", "bogus")
    assert_one_clear_line(out, "unknown row 'bogus'; valid names: keys, ingest, memory, floor, outage, http, scaling, cluster")
    out = kvpf("bench", "--only", "keys,warnigs")  # issue 27, finding 9: a did-you-mean, as for options
    assert_one_clear_line(out, "unknown row 'warnigs' (did you mean 'warnings'?)")


def test_tokenizer_check_against_a_dead_engine_says_unreachable():
    """It said the engine's root "is not a local directory"."""
    out = kvpf("tokenizer", "check", "--model", "m", "--engine-url", DEAD_HTTP)
    assert_one_clear_line(out, f"the engine at {DEAD_HTTP} is unreachable")
    assert out.returncode == 2 and "local directory" not in out.stderr


def test_accuracy_shows_the_engines_400_in_one_line(valkey_url, tmp_path):
    """The engine's message was hidden behind an httpx traceback."""
    engine = sim_engine("sim-acc", tmp_path).start()
    port = free_port()
    predictor = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--engine-url", f"sim={engine.url}",
                       "--no-tokenizer-check"], str(tmp_path / "serve.log"))
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        workload = tmp_path / "w.jsonl"
        workload.write_text(json.dumps({"token_ids": list(range(1, 601))}) + "\n")  # > max_model_len 512
        out = kvpf("accuracy", "--engine-url", engine.url, "--predictor-url", f"http://127.0.0.1:{port}",
                   "--model", "sim", "--workload", str(workload))
        assert_one_clear_line(out, "the engine answered 400: ")
        assert "max_model_len" in out.stderr or "maximum context length" in out.stderr, out.stderr
    finally:
        stop(predictor)
        engine.stop()


@pytest.mark.parametrize("data_dir", ["a-file", "a-file/data", "logs-a-file"])
def test_up_refuses_a_data_dir_it_cannot_use_before_starting_anything(tmp_path, data_dir):
    """`up --data-dir` on a file, below a file, or where logs/ is a file: one error line and nothing started.
    Below a file, up printed its first step and failed with a traceback; with logs/ a file, it did so once
    valkey-server was up."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "logs-a-file").mkdir()
    (tmp_path / "logs-a-file" / "logs").write_text("")
    with reaped(tmp_path) as env:
        out = kvpf("up", "--data-dir", str(tmp_path / data_dir), "--port", str(free_port()), env=env, cwd=tmp_path)
        assert not stack_pids(tmp_path)
    assert_one_clear_line(out, "--data-dir")
    assert "[1/5]" not in out.stdout, out.stdout  # refused before the first step
    assert not (tmp_path / "logs-a-file" / "valkey").exists()


# ---- every command, bad input

# Options whose value is free text: no value is wrong in itself.
FREE_TEXT = {"--model", "--pod", "--pods", "--hash-seed", "--host", "--metrics-host", "--prompt", "--compare-prompt",
             "--cache-salt", "--ingester-id", "--api-key", "--topic", "--lora", "--register-ipc-dir"}
# Long-running commands: a dependency that is down is waited for and logged, not an input error.
DAEMONS = {"ingest", "serve", "gateway", "up", "simulate"}
# Where a generic bad value does not apply: (command, flag, case) -> why
NOT_BAD = {
    ("calibrate", "--output", "bad-path"): "a new file is written there: any path is a valid output",
    ("index export", "--output", "bad-path"): "a new file is written there: any path is a valid output",
}


# The cases are made while collecting, before pytest empties --basetemp for the tests' own tmp_path: a file
# made then was gone when its test ran. `up --data-dir <that file>` then got a free path and started a whole
# stack, killed at 60 s with its children left running. Values name the test's files under TMP instead;
# the test makes them (_make_files) in its tmp_path.
TMP = "{tmp}"


def _make_files(tmp_path) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "workload.jsonl").write_text('{"token_ids": [1, 2, 3]}\n')
    (tmp_path / "obs.jsonl").write_text("".join(json.dumps({"prompt_tokens": 100 * i, "cached_tokens": 0, "ttft_ms": 10 + i})
                                                + "\n" for i in range(1, 6)))


def _bad_values(cmd_name: str, opt: click.Option) -> list[tuple[str, str]]:
    """(case, value) pairs that are wrong for ``opt``."""
    flag = next((o for o in opt.opts if o.startswith("--")), opt.opts[0])
    t = opt.type
    if opt.is_flag:
        return []
    if isinstance(t, click.Choice):
        return [("bogus-choice", "bogus")]
    if isinstance(t, (click.IntRange, click.FloatRange)) or t in (click.INT, click.FLOAT):
        low = getattr(t, "min", None)
        return [("not-a-number", "bogus")] + ([("below-range", str(low - 1))] if low is not None else [])
    if isinstance(t, click.File):
        return [("bad-path", "/nonexistent/kvpf.file")] if "r" in t.mode else [("bad-path", "/nonexistent/dir/x")]
    if isinstance(t, click.Path):
        if not t.exists:
            blocker = f"{TMP}/a-file"
            return [("bad-path", f"{blocker}/x" if t.file_okay else blocker)]
        return [("bad-path", "/nonexistent/kvpf")]
    if flag == "--valkey-url":
        cases = [("no-scheme", "localhost:1")]
        return cases + ([] if cmd_name in DAEMONS else [("unreachable", DEAD_VALKEY)])
    if flag in ("--tokens", "--compare-tokens"):
        return [("missing-file", "@/nonexistent"), ("not-json", "[1,"), ("not-a-list", "{}")]
    if flag in ("--messages", "--compare-messages"):
        return [("not-json", "[1,")]
    if flag == "--url":
        return [("no-scheme", "localhost:1"), ("unreachable", "http://127.0.0.1:9")]
    if flag == "--engines-from":
        return [("bad-scheme", "bogus://x")]
    if flag == "--only":  # bench's rows
        return [("unknown-row", "bogus")]
    if flag == "--target-ports":
        return [("not-ports", "abc")]
    if flag == "--register-allow":
        return [("not-a-host-or-cidr", "10.0.0.0/99")]
    if flag in ("--engine-url", "--predictor-url", "--engine", "--pod-metrics"):
        cases = [("no-scheme", "localhost:1" if "=" not in _good(cmd_name, opt) else "m=localhost:1")]
        return cases + ([] if cmd_name in DAEMONS else [("unreachable", _good(cmd_name, opt))])
    if flag in ("--source", "--bind", "--zmq", "--replay"):
        return [("bad-endpoint", "nonsense")]
    if flag in ("--tokenizer", "--route-tier-weight", "--lora-name"):
        return [("bad-pair", "no-equals-sign")]
    if flag == "--group-spec":
        return [("bad-spec", "no-colon-or-equals")]
    if flag in FREE_TEXT:
        return []
    raise AssertionError(f"{cmd_name} {flag}: classify this option (a bad value, or FREE_TEXT)")


def _good(cmd_name: str, opt: click.Option) -> str:
    """A well-formed value for a required option (its service, if any, is down)."""
    flag = next((o for o in opt.opts if o.startswith("--")), opt.opts[0])
    return {"--tokens": "[1, 2, 3]", "--engine-url": "m=" + DEAD_HTTP if cmd_name in ("serve", "gateway") else DEAD_HTTP,
            "--predictor-url": DEAD_HTTP, "--engine": DEAD_HTTP, "--valkey-url": DEAD_VALKEY,
            "--pod-metrics": "p=" + DEAD_HTTP}.get(flag, "m")


def _cases():
    good_files = {"--workload": f"{TMP}/workload.jsonl", "--input": f"{TMP}/obs.jsonl"}
    out = []
    for path, cmd in walk(cli):
        name = " ".join(path)
        opts = [p for p in cmd.params if isinstance(p, click.Option)]
        base = []
        for o in opts:
            if o.required:
                base += [o.opts[-1], good_files.get(o.opts[-1]) or _good(name, o)]
        if any("--model" in o.opts and not o.required for o in opts) and name not in DAEMONS:
            base += ["--model", "m"]  # else a missing model (taken from a stack or the fleet) is the error
        out.append((name, [*path, *base, "--no-such-option"], "unknown option"))
        for o in opts:
            for case, value in _bad_values(name, o):
                flag = next((f for f in o.opts if f.startswith("--")), o.opts[0])
                if (name, flag, case) in NOT_BAD:
                    continue
                args = [a for i, a in enumerate(base) if not (base[i - (i % 2)] == o.opts[-1])]
                out.append((name, [*path, *args, flag, value], f"{flag} {case}"))
    return out


def pytest_generate_tests(metafunc):
    if "bad_args" in metafunc.fixturenames:
        cases = _cases()
        metafunc.parametrize("bad_args", [c[1] for c in cases], ids=[f"{c[0]} {c[2]}" for c in cases])


def _refused_by_click(args: list[str]) -> bool:
    """Whether click refuses ``args`` while parsing, before the command (a server) would start."""
    try:
        cli.commands[args[0]].make_context(args[0], list(args[1:]))
    except click.ClickException:
        return True
    return False


def test_every_command_with_bad_input_is_one_clear_line(bad_args, monkeypatch, tmp_path):
    for name in [k for k in os.environ if k.startswith("KVPF_")]:
        monkeypatch.delenv(name)
    _make_files(tmp_path)
    bad_args = [a.replace(TMP, str(tmp_path)) for a in bad_args]
    if bad_args[0] not in DAEMONS or _refused_by_click(bad_args):
        # in this process (fast); an exception that escapes click is the traceback a user would see
        res = CliRunner().invoke(cli, bad_args)
        if not isinstance(res.exception, SystemExit) and res.exception is not None:
            import traceback

            raise AssertionError("Traceback:\n" + "".join(traceback.format_exception(res.exception)))
        assert_one_clear_line(subprocess.CompletedProcess(bad_args, res.exit_code, res.stdout, res.stderr))
        return
    with reaped(tmp_path) as env:  # a daemon that took the input ends here with whatever it started
        proc = subprocess.Popen([sys.executable, "-m", "kv_preflight", *bad_args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL, cwd=tmp_path)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"{' '.join(bad_args)}: still running after 60 s, bad input accepted")
    assert_one_clear_line(subprocess.CompletedProcess(bad_args, proc.returncode, stdout, stderr))


def _answers(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("stale", [False, True])
def test_no_stack_found_names_where_it_looked_and_how_to_point_at_one(tmp_path, stale):
    """Issue 27, finding 2: with no running `up` stack found, `index stats` said only "Error 111 connecting to
    127.0.0.1:6379", and `explain` only "cannot reach the predictor at http://127.0.0.1:8080". Each now
    names the env file it looked for, why it did not count, and how to point at a stack."""
    if _answers(6379) or _answers(8080):
        pytest.skip("something listens on a built-in default port here: the defaults would connect")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPF_")}
    if stale:  # left by an up killed with -9: its lock is gone, so the file does not count
        (tmp_path / ".data").mkdir()
        stack_file.write(tmp_path / ".data", {"KVPF_VALKEY_URL": DEAD_VALKEY})
    state = "is left by an `up` that has stopped" if stale else "does not exist"
    for args, flag in ((["index", "stats"], "--valkey-url"), (["explain", "--model", "m", "--prompt", "x"],
                                                             "--predictor-url")):
        out = kvpf(*args, cwd=tmp_path, env=env)
        assert_one_clear_line(out, "no running `kv-preflight up` stack was found")
        assert f"{tmp_path / '.data' / 'env'} (./.data, as KVPF_DATA_DIR is unset) {state}" in out.stderr, out.stderr
        assert "export KVPF_DATA_DIR=<its --data-dir>" in out.stderr and f"or give {flag}" in out.stderr, out.stderr
    out = kvpf("index", "stats", "--valkey-url", DEAD_VALKEY, cwd=tmp_path, env=env)  # a URL given: no hint
    assert_one_clear_line(out, "Valkey error")
    assert "no running" not in out.stderr


def test_a_bad_url_from_the_environment_names_its_variable(tmp_path):
    """Issue 42, item 7: a bad KVPF_VALKEY_URL (unreachable, or no scheme) failed as if the command had chosen
    the URL; the built-in default case said where it looked. Each now names the variable (explain's
    KVPF_PREDICTOR_URL too), and a URL a running stack's env file set names that file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPF_")}
    for url, says in ((DEAD_VALKEY, "Valkey error"), ("localhost:6379", "needs a scheme")):
        out = kvpf("index", "stats", cwd=tmp_path, env=dict(env, KVPF_VALKEY_URL=url))
        assert_one_clear_line(out, says)
        assert "from the environment variable KVPF_VALKEY_URL" in out.stderr and "--valkey-url" in out.stderr, out.stderr
    out = kvpf("explain", "--model", "m", "--prompt", "x", cwd=tmp_path, env=dict(env, KVPF_PREDICTOR_URL=DEAD_HTTP))
    assert_one_clear_line(out, "cannot reach the predictor")
    assert "from the environment variable KVPF_PREDICTOR_URL" in out.stderr, out.stderr
    # a running stack's env file (its lock held, as `up` holds it) set the URL: the file is named
    data = tmp_path / ".data"
    data.mkdir()
    lock = stack_file.DataDirLock(data).acquire("test")
    try:
        stack_file.write(data, {"KVPF_VALKEY_URL": DEAD_VALKEY})
        out = kvpf("index", "stats", cwd=tmp_path, env=env)
        assert_one_clear_line(out, "Valkey error")
        assert f"as the running `kv-preflight up` stack's env file {data / 'env'} sets it" in out.stderr, out.stderr
    finally:
        lock.release()
