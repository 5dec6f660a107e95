"""The wheel as a user gets it: built from the source tree and installed into a clean venv (the
dependencies from the package index, as ``pip install`` would), then used from outside the source
tree: its top-level names, its entry point, and its package data (the Lua scripts) are all there.
"""
from __future__ import annotations

import json
import os
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the wheel puts in site-packages beside its dist-info: the one package, whose folder is its import path.
TOP_LEVEL = frozenset({"kv_preflight"})
SOURCE_FOLDERS = ("kv_preflight",)


def wheel_path(source: str) -> str:
    """Where a file of the source tree lands in the wheel: at the same path (a plain package, no mapping)."""
    return source


def package_data() -> list[str]:
    """Every tracked file of the packages that is neither Python nor C source: it must ship."""
    out = subprocess.run(["git", "ls-files", *SOURCE_FOLDERS], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [f for f in out.stdout.split() if not f.endswith((".py", ".c"))]
    assert any(f.endswith(".lua") for f in files), "the Lua scripts are package data"
    return files


def clean_env() -> dict[str, str]:
    """No PYTHONPATH (the tests put the source tree on it) and no venv of the caller's."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    run = dict(capture_output=True, text=True, env=clean_env(), cwd=tmp, timeout=900)
    built = subprocess.run([str(py), "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(ROOT)], **run)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("kv_preflight-*.whl")
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)], **run)
    assert done.returncode == 0, done.stderr[-3000:]
    return wheel, env_dir


def test_wheel_top_level_names(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level_txt = [z.read(n).decode() for n in names if n.endswith(".dist-info/top_level.txt")]
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert tops == TOP_LEVEL
    for text in top_level_txt:  # what pip and importlib.metadata report
        assert set(text.split()) == TOP_LEVEL


def test_wheel_holds_the_package_data(installed):
    wheel, env_dir = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = [f for f in package_data() if wheel_path(f) not in names]
    assert not missing, f"not in the wheel: {missing}"
    # and they load from the installed package, outside the source tree
    module = wheel_path("kv_preflight/index/scripts.py")[:-3].replace("/", ".")
    probe = (f"import importlib, json; m = importlib.import_module({module!r}); "
             "print(json.dumps([m.__file__, len(m.APPLY)]))")
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                         env=clean_env(), cwd=env_dir, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    path, size = json.loads(out.stdout)
    assert path.startswith(str(env_dir)) and size > 0


def test_entry_point_runs_from_the_clean_venv(installed):
    wheel, env_dir = installed
    with zipfile.ZipFile(wheel) as z:
        entry_points = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "[console_scripts]" in entry_points and "kv-preflight = " in entry_points
    exe = env_dir / "bin" / "kv-preflight"
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=clean_env(),
                             cwd=env_dir, timeout=120)
    assert version.returncode == 0 and "0." in version.stdout, version
    # it says whether the C block-key routine is in, as the installed package has it; python -m is the same command
    has_c = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                            "from kv_preflight.keys.chain import HAS_C_EXTENSION as c; print(c)"],
                           capture_output=True, text=True, env=clean_env(), cwd=env_dir, timeout=120)
    assert has_c.returncode == 0, has_c.stderr[-2000:]
    said = "C block-key routine: built" if has_c.stdout.strip() == "True" else "C block-key routine: not built"
    assert said in version.stdout, version.stdout
    as_module = subprocess.run([str(env_dir / "bin" / "python"), "-m", "kv_preflight", "--version"], capture_output=True,
                               text=True, env=clean_env(), cwd=env_dir, timeout=120)
    assert as_module.returncode == 0 and said in as_module.stdout, as_module
    keys = subprocess.run([str(exe), "keys", "--model", "m", "--tokens", json.dumps(list(range(32)))],
                          capture_output=True, text=True, env=clean_env(), cwd=env_dir, timeout=120)
    assert keys.returncode == 0 and len(json.loads(keys.stdout)) == 2, keys

