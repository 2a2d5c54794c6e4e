"""The built wheel works on its own: installed outside the source tree, it migrates an empty
database and runs a run end to end.

How the wheel is installed, and why: the wheel is built from a copy of the source tree with
`python -m build --wheel` (an isolated build, as a release would be), then installed with
`pip install --no-deps` into a fresh virtualenv whose only link to this test environment is a
`.pth` file naming this environment's site-packages, so psycopg, orjson and OpenTelemetry
resolve without downloading them on every run (that would take most of a minute). A `.pth`
line only appends its directory to sys.path: the wheel's own `runpool` comes first, and an
editable install of runpool in this environment (its own `.pth` and finder are not processed)
stays invisible, which the test checks. The dependencies the wheel would pull from an index
are checked separately, in its metadata. Everything runs from a temporary directory, with no
PYTHONPATH, so the source tree is not importable.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import uuid
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

import psycopg
import pytest

import runpool
from runpool.migrate import migrations
from tests.helpers import ROOT, run_row, wait_for

# A wheel build and a venv's install, beside the suite's other processes: past the
# default timeout (180 s) only on a machine far busier than the builds' own bounds allow.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Not part of a distribution: copying them would only slow the build down.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache",
    ".ruff_cache", ".pytest_cache", ".runpool", ".hypothesis")

# The app the installed pool runs: a tool call and a message, checkpointed as usual.
_APP = '''
import runpool

app = runpool.App()


def shout(arguments, key):
    return arguments["text"].upper()


@app.handler("greet")
async def greet(run: runpool.Run):
    loud = await run.tool("c1", "shout", {"text": run.input["name"]}, shout)
    await run.add_message("assistant", f"hello {loud}")
    return {"greeting": loud, "runpool_file": runpool.__file__}
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runpool's wheel, built from a copy of this source tree."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    # symlinks=True: runpool/migrations stays the link to migrations/ it is in the repository.
    shutil.copytree(ROOT, src, symlinks=True, ignore=_NOT_SOURCE)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(work / "dist"),
                    str(src)], check=True, capture_output=True, timeout=240)
    (built,) = (work / "dist").glob("runpool-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the wheel installed; returns its python."""
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True,
                   timeout=60)
    python = home / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=120,
                   env=_clean_env())
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=_clean_env()).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_runpool_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RUNPOOL_", "OTEL_", "PYTHON", "PIP_REQUIRE"))}
    env.pop("DATABASE_URL", None)
    env.update(extra)
    return env


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_wheel__carries_every_module_migration_query_file_and_marker(wheel: Path) -> None:
    names = _wheel_names(wheel)
    expected = {"runpool/py.typed", "checkpoints/py.typed"}
    for package in ("runpool", "checkpoints"):
        for path in (ROOT / package).rglob("*"):
            rel = path.relative_to(ROOT)
            # The web console's templates and static files ship as package data.
            if path.suffix in (".py", ".sql", ".html", ".css", ".js") \
                    and "migrations" not in rel.parts \
                    and "__pycache__" not in rel.parts:
                expected.add(rel.as_posix())
    # The one copy of the SQL is the top-level migrations/ directory; all of it ships.
    expected |= {f"runpool/migrations/{p.name}" for p in (ROOT / "migrations").glob("*.sql")}
    assert expected - names == set()
    assert len([n for n in names if n.startswith("runpool/migrations/")]) == len(migrations())
    assert not [n for n in names if n.startswith(("tests/", "migrations/"))]


def test_wheel__metadata_declares_dependencies_license_and_urls(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
    assert meta["Version"] == runpool.__version__
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    required = {r for r in meta.get_all("Requires-Dist", []) if "extra ==" not in r}

    def name(req: str) -> str:
        return re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()

    assert {name(r) for r in required} == {name(d) for d in declared} == {
        "psycopg", "psycopg-pool", "orjson", "opentelemetry-sdk", "cronsim", "tzdata", "uvloop"}
    # uvloop has no Windows build: a dependency only where it installs.
    (uvloop,) = [r for r in required if name(r) == "uvloop"]
    assert "sys_platform != \"win32\"" in uvloop.replace("'", '"')
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("Project-URL")
    assert any(n.endswith("/licenses/LICENSE") for n in _wheel_names(wheel))


def test_installed_wheel__migrates_an_empty_database_and_runs_a_run(
        venv: Path, empty_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "shipapp.py").write_text(_APP)
    env = _clean_env(RUNPOOL_DSN=empty_dsn)

    def runpool_cmd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv), "-m", "runpool", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    where = subprocess.run([str(venv), "-c", "import runpool; print(runpool.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv.parent.parent), where.stdout
    out = runpool_cmd("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"runpool {runpool.__version__}")
    script = subprocess.run([str(venv.parent / "runpool"), "--version"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert script.stdout.strip() == f"runpool {runpool.__version__}", script.stderr

    # The web console finds its templates and static files in the installed package.
    web = subprocess.run(
        [str(venv), "-c", "from importlib.resources import files; import runpool.web.console as c;"
         " c.TEMPLATES.get_template('run.html');"
         " print((files('runpool.web') / 'static' / 'console.js').is_file(), c.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert web.returncode == 0, web.stderr
    shown, where_web = web.stdout.split()
    assert shown == "True" and Path(where_web).is_relative_to(venv.parent.parent)

    out = runpool_cmd("migrate")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"applied {m.version:04d}_{m.name}"
                                       for m in migrations()]
    assert runpool_cmd("migrate").stdout.strip() == "schema is up to date"

    out = runpool_cmd("enqueue", "acme", "greet", "--input", '{"name": "ada"}')
    assert out.returncode == 0, out.stderr
    run_id = uuid.UUID(out.stdout.strip())
    pool = subprocess.Popen(
        [str(venv), "-m", "runpool", "worker", "--app", "shipapp:app", "--workers", "1",
         "--concurrency", "2", "--poll", "0.2"],
        cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            row = wait_for(lambda: _finished(conn, run_id), timeout=30, what="the run")
            assert row is not None
            assert row["status"] == "succeeded", row
            assert row["result"]["greeting"] == "ADA"
            assert Path(row["result"]["runpool_file"]).is_relative_to(venv.parent.parent)
            contents = [c for (c,) in conn.execute(
                "SELECT content FROM runpool.messages WHERE run_id = %s ORDER BY seq",
                (run_id,))]
            assert contents == ["ADA", "hello ADA"]
        pool.send_signal(signal.SIGTERM)
        _, err = pool.communicate(timeout=30)
        assert pool.returncode == 0, err
    finally:
        if pool.poll() is None:
            os.killpg(pool.pid, signal.SIGKILL)
            pool.wait()


def _finished(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> dict[str, Any] | None:
    row = run_row(conn, run_id)
    return row if row["status"] in ("succeeded", "failed", "cancelled") else None
