"""The W5-W10 regression check (runpool.harness.regressions) over two stand-in source trees:
each tree's `runpool/__main__.py` is a script that prints what a workload would, so the order
of the runs, the environment each tree gets, the failures, the timeouts and the verdicts are
checked in seconds, without the minutes the real workloads take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runpool.harness.regressions import direction, main, verdict
from tests.helpers import ROOT, wait_for

# A stand-in `python -m runpool bench`: logs how it was run, then prints what its tree's
# spec.json says for the workload (a JSON line; "fail": exit 3; "hang": wait for SIGINT; a
# list: one of those run by run).
FAKE_BENCH = '''
import json, os, sys, time
from pathlib import Path

tree = Path(__file__).resolve().parents[1]
args = sys.argv[1:]
workload = args[args.index("--workload") + 1]
log = tree.parent / "order.log"
fit = (os.environ.get("PYTHONPATH") == str(tree) and Path.cwd() == tree
       and not any(k.startswith("RUNPOOL_") for k in os.environ)
       and "DATABASE_URL" not in os.environ and args[:3] == ["bench", "--dsn", "DSN"])
with log.open("a") as f:
    f.write(f"{tree.name} {workload} {'fit' if fit else 'UNFIT'}\\n")
# The second run of a workload in a tree is 0.5 slower: a spread of 0.5 a side.
n = sum(line.startswith(f"{tree.name} {workload} ") for line in log.read_text().splitlines())
spec = json.loads((tree / "spec.json").read_text())[workload]
if isinstance(spec, list):  # run by run, the last one repeated
    spec = spec[min(n, len(spec)) - 1]
if spec == "fail":
    sys.exit(3)
if spec == "hang":
    try:
        time.sleep(600)
    except KeyboardInterrupt:
        with log.open("a") as f:
            f.write(f"{tree.name} {workload} interrupted\\n")
        sys.exit(1)
jitter = (n - 1) % 2 * 0.5
print("a log line first")
print(json.dumps({"workload": workload, **{k: v + jitter if isinstance(v, float) else v
                                           for k, v in spec.items()}}))
'''

OLD = {"W5": {"alone_p95_s": 1.0, "shared_p95_s": {"small1": 1.0}, "worst_ratio": 1.0},
       "W7": {"calls": 1000, "p50_ms": 10.0, "runs_per_s": 100.0},
       "W9": {"p50_ms": 5.0},
       "W10": {"runs_per_s": 100.0, "order_violations": 0}}
NEW = {"W5": {"alone_p95_s": 1.0, "shared_p95_s": {"small1": 3.0}, "worst_ratio": 0.25},
       "W7": {"calls": 1000, "p50_ms": 20.0, "runs_per_s": 100.0},
       "W9": "fail",
       "W10": {"runs_per_s": 100.0, "order_violations": 1}}


def _tree(root: Path, name: str, spec: dict[str, object]) -> Path:
    (root / name / "runpool").mkdir(parents=True)
    (root / name / "runpool" / "__main__.py").write_text(FAKE_BENCH)
    (root / name / "spec.json").write_text(json.dumps(spec))
    return root / name


def _row(out: str, workload: str, metric: str) -> list[str]:
    """The table row of `metric` under `workload`'s heading, split on whitespace."""
    section = out.split(f"\n{workload}  (")[1].split("\n\n")[0]
    return next(line.split() for line in section.splitlines()
                if line.split() and line.split()[0] == metric)


def test_regressions__alternates_the_trees_and_flags_what_got_worse(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNPOOL_CONCURRENCY", "7")
    monkeypatch.setenv("DATABASE_URL", "postgresql://elsewhere")
    old, new = _tree(tmp_path, "old", OLD), _tree(tmp_path, "new", NEW)
    out_file = tmp_path / "samples.jsonl"
    status = main(["--old", str(old), "--new", str(new), "--dsn", "DSN", "--pairs", "2",
                   "--workloads", "W5", "W7", "W9", "W10", "--confirm", "0",
                   "--out", str(out_file)])
    out = capsys.readouterr().out
    assert status == 1, out
    # Workload by workload, OLD first in odd pairs and NEW first in even ones; each in its own
    # tree, its environment cleaned.
    runs = (tmp_path / "order.log").read_text().splitlines()
    assert runs == [f"{side} {w} fit" for order in (("old", "new"), ("new", "old"))
                    for w in ("W5", "W7", "W9", "W10") for side in order]
    # Beyond the pairs' spread (0.5 a side) the wrong way, the right way, within it.
    assert _row(out, "W7", "p50_ms")[1:6] == ["lower", "10.25", "20.25", "1.98", "10-10.5"]
    assert _row(out, "W7", "p50_ms")[-1] == "WORSE"
    assert _row(out, "W7", "runs_per_s")[-2:] == ["0/2", "~"]  # worse in no pair, within
    assert _row(out, "W7", "p50_ms")[-2] == "2/2"
    assert _row(out, "W5", "shared_p95_s/small1")[-1] == "WORSE"
    assert _row(out, "W5", "worst_ratio")[-1] == "better"
    assert _row(out, "W10", "order_violations")[-1] == "BROKEN"
    assert "FAILED: NEW failed 2 times, OLD 0" in out
    assert "new pair 1: exit status 3, no JSON line" in out
    # A size is not a metric; the bench process tree's CPU is one, its wall time is shown.
    assert not any(line.split()[:1] == ["calls"] for line in out.splitlines())
    assert _row(out, "W7", "client_cpu_s")[1] == "lower"
    assert _row(out, "W7", "wall_s")[1] != "lower"
    # The saved samples give the same table again.
    assert main(["--report", str(out_file)]) == 1
    again = capsys.readouterr().out
    assert again.split("\n\n", 1)[1] == out.split("\n\n", 1)[1]


def test_regressions__a_bench_past_its_timeout_is_interrupted_and_counted_failed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _tree(tmp_path, "old", {"W7": {"p50_ms": 1.0}})
    new = _tree(tmp_path, "new", {"W7": "hang"})
    status = main(["--old", str(old), "--new", str(new), "--dsn", "DSN", "--pairs", "1",
                   "--workloads", "W7", "--timeout", "3", "--confirm", "0",
                   "--out", str(tmp_path / "s.jsonl")])
    out = capsys.readouterr().out
    assert status == 1
    assert "FAILED: NEW failed 1 times, OLD 0" in out and "timed out after 3 s" in out
    assert (tmp_path / "order.log").read_text().splitlines()[-1] == "new W7 interrupted"


def test_regressions__a_flagged_workload_is_run_again_and_judged_on_every_pair(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # NEW is slower in its first three runs only (a noisy neighbour): flagged after two pairs
    # and after three, within the spread of all four.
    old = _tree(tmp_path, "old", {"W7": {"p50_ms": 10.0}, "W9": {"p50_ms": 5.0}})
    new = _tree(tmp_path, "new", {"W7": [{"p50_ms": 20.0}] * 3 + [{"p50_ms": 10.0}],
                                  "W9": {"p50_ms": 5.0}})
    main(["--old", str(old), "--new", str(new), "--dsn", "DSN", "--pairs", "2",
          "--workloads", "W7", "W9", "--confirm", "2", "--out", str(tmp_path / "s.jsonl")])
    out = capsys.readouterr().out
    runs = [line.rsplit(" ", 1)[0]
            for line in (tmp_path / "order.log").read_text().splitlines()]
    assert runs == ["old W7", "new W7", "old W9", "new W9", "new W7", "old W7", "new W9",
                    "old W9", "old W7", "new W7", "new W7", "old W7"]
    assert "W7  (ok: old 4/4, new 4/4 runs)" in out
    assert _row(out, "W7", "p50_ms")[1:7] == ["lower", "10.25", "20", "1.95", "10-10.5",
                                              "10.5-20.5"]
    assert _row(out, "W7", "p50_ms")[-2:] == ["3/4", "~"]


@pytest.mark.parametrize(("metric", "better"), [
    # What W5-W10 print today (python -m runpool bench --workload W5 ... W10).
    ("alone_p95_s", -1), ("shared_p95_s/small1", -1), ("worst_ratio", -1),
    ("p50_ms_1m", -1), ("p99_ms_100k", -1), ("p50_ratio_1m_to_1k", -1),
    ("p50_ratio_paused_2k_to_empty", -1), ("p50_ms", -1), ("resume_ms", -1),
    ("handler_start_to_first_new_call_ms", -1), ("bytes_per_call_at_1000", -1),
    ("no_listen_max_ms", -1), ("runs_per_s", 1), ("enqueue_per_s", 1),
    ("order_violations", -1), ("client_cpu_s", -1), ("wall_s", None),
])
def test_direction__every_w5_to_w10_metric_is_judged_the_right_way(
        metric: str, better: int | None) -> None:
    assert direction(metric) == better


def test_verdict__needs_two_values_a_side_and_a_change_beyond_both_spreads() -> None:
    assert verdict("p50_ms", [10.0], [30.0]) == "?"
    assert verdict("p50_ms", [10.0, 12.0], [13.0, 15.0]) == "WORSE"  # 3 > spread 2
    assert verdict("p50_ms", [10.0, 12.0], [11.0, 15.0]) == "~"     # 2 < spread 4
    assert verdict("runs_per_s", [10.0, 12.0], [13.0, 15.0]) == "better"
    assert verdict("p50_ms", [10.0, 10.0], [10.5, 10.5], tolerance=0.1) == "~"
    assert verdict("order_violations", [0.0, 0.0], [0.0, 2.0]) == "BROKEN"


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_regressions__stopped_by_sigterm_it_stops_the_bench_it_runs(tmp_path: Path,
                                                                    sigint: str) -> None:
    # The bench runs in a session of its own: `timeout` or a kill reaches only the harness.
    # "ignored": started as a script's background job (`cmd &` ignores SIGINT), which its
    # benches would inherit: the SIGINT that stops one would be lost.
    old = _tree(tmp_path, "old", {"W7": "hang"})
    new = _tree(tmp_path, "new", {"W7": "hang"})
    command = [sys.executable, "-m", "runpool.harness.regressions", "--old", str(old), "--new",
               str(new), "--dsn", "DSN", "--pairs", "1", "--workloads", "W7",
               "--out", str(tmp_path / "s.jsonl")]
    if sigint == "ignored":
        command = ["bash", "-c", 'trap "" INT; exec "$@"', "bash", *command]
    harness = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.DEVNULL)
    log = tmp_path / "order.log"
    wait_for(lambda: log.exists() and log.read_text().startswith("old W7 fit"), 30,
             what="the first bench to start")
    harness.terminate()
    assert harness.wait(timeout=90) != 0
    assert log.read_text().splitlines() == ["old W7 fit", "old W7 interrupted"]


def test_verdict__a_cpu_difference_under_its_resolution_is_not_judged() -> None:
    # Two fake benches' interpreter starts, a hundredth or two apart (what flagged W9 now and
    # then in the test above, and had it run again).
    assert verdict("client_cpu_s", [0.03, 0.03], [0.05, 0.05]) == "~"
    assert verdict("client_cpu_s", [1.0, 1.02], [1.5, 1.51]) == "WORSE"
    assert verdict("p50_ms", [0.03, 0.03], [0.05, 0.05]) == "WORSE"
