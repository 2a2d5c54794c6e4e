"""`python -m runpool.harness.regressions --old TREE --new TREE --dsn DSN`: issue 20's check
that no other workload got worse ("Regressions of other workloads (W5-W10) are not allowed:
re-run them").

Each source tree runs its own `python -m runpool bench --dsn DSN --workload W` (PYTHONPATH set
to the tree, its working directory the tree, RUNPOOL_* and DATABASE_URL removed so both run
with the defaults), one workload at a time, OLD and NEW in turn (OLD first in odd pairs, NEW
first in even ones), for `--pairs` pairs: each workload's OLD and NEW sit minutes apart at
most, so a machine whose load drifts moves both.
Every sample goes to a JSON-lines file as it comes (`--report FILE` prints the table again from
one, finished or not). The table gives, per workload and metric, the medians side by side,
NEW/OLD, each side's range, and a verdict: WORSE when the medians differ, the wrong way, by
more than the larger of the two sides' ranges (the pairs' own spread); better the other way;
~ within it. A count that must stay zero (order_violations) is BROKEN once NEW reports one;
a workload NEW fails more often than OLD (exit status, no JSON line, timeout) is FAILED. A
flagged workload runs `--confirm` pairs more (2), and is judged again on all its pairs: on a
loaded machine two or three pairs flag noise now and then. Beside each workload's metrics:
client_cpu_s, the CPU seconds of the bench process and every pool it ran (waited-for
children, so less load-dependent than times; a difference under 0.1 s is not judged), and
wall_s (shown, not judged). Exit status 1
if anything is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, TextIO

__all__ = ["Sample", "direction", "main", "render", "run_one", "verdict"]

DEFAULT_WORKLOADS: Final = ("W5", "W6", "W7", "W8", "W9", "W10")
# What the workloads print that sizes the work rather than measures it.
PARAMETERS: Final = frozenset({"workload", "runs", "keys", "calls", "cancels", "workers",
                               "no_listen_cancels", "no_listen_heartbeat_s", "repeats",
                               "seconds", "window_s", "window_bound"})
# Counts that must be zero in every run: one is a broken guarantee, not a slower run.
MUST_BE_ZERO: Final = frozenset({"order_violations"})
# The least difference of a metric's medians that is judged at all: client_cpu_s is read from
# rusage in hundredths, and a bench's own start (its interpreter's import of runpool) differs
# by a few of them run to run, which two pairs' spread of a short workload can be under.
LEAST_DIFFERENCE: Final = {"client_cpu_s": 0.1}
# Shown beside the metrics, never judged (the machine's load decides it more than the code).
INFORMATIONAL: Final = frozenset({"wall_s"})
# How long a bench process gets after SIGINT (its pools stopped, its databases dropped).
INTERRUPT_GRACE: Final = 60.0


@dataclass(frozen=True)
class Sample:
    """One `bench --workload` process of one tree: what it printed, or why it printed nothing."""

    side: str  # "old" or "new"
    pair: int
    workload: str
    ok: bool
    metrics: dict[str, float]
    params: dict[str, Any]
    load: float  # the 1-minute load average when it started
    error: str = ""


def direction(metric: str) -> int | None:
    """+1 if higher is better, -1 if lower is, None when not judged. Read from the name: the
    workloads' metrics are rates (per_s), times (_ms, _s), sizes (bytes) and ratios of them."""
    base = metric.split("/")[0]
    if base in INFORMATIONAL:
        return None
    if base in MUST_BE_ZERO:
        return -1
    if "per_s" in base:
        return 1
    if base.endswith(("_ms", "_s", "_us")) or "_ms_" in base or "ratio" in base \
            or "bytes" in base:
        return -1
    return None


def _split(result: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """A workload's JSON line as (metrics, parameters); nested numbers (W5's per-tenant
    waits) become `key/inner` metrics."""
    metrics: dict[str, float] = {}
    params: dict[str, Any] = {}
    for key, value in result.items():
        if key in PARAMETERS:
            params[key] = value
        elif isinstance(value, dict):
            metrics.update({f"{key}/{k}": float(v) for k, v in value.items()
                            if isinstance(v, int | float)})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            metrics[key] = float(value)
        else:
            params[key] = value
    return metrics, params


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc): a pool runs in a session of its own, so
    signalling the bench's process group does not reach it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGINT (the bench's `with` blocks stop its pools and drop its databases), then after the
    grace SIGKILL to the bench and every process group under it."""
    tree = _descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=INTERRUPT_GRACE)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *tree]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return proc.communicate()


def run_one(python: str, tree: Path, side: str, pair: int, workload: str, dsn: str,
            timeout: float) -> Sample:
    """Run one workload from `tree` and read its JSON line."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RUNPOOL_") and k != "DATABASE_URL"}
    env["PYTHONPATH"] = str(tree)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.Popen(
        [python, "-m", "runpool", "bench", "--dsn", dsn, "--workload", workload],
        cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    error = ""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _stop(proc)
        error = f"timed out after {timeout:g} s"
    except KeyboardInterrupt:
        # Its own session spares it the terminal's SIGINT: pass ours on before giving up.
        _stop(proc)
        raise
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result = None
    for line in out.splitlines():
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict) and "workload" in parsed:
            result = parsed
    if proc.returncode != 0 or result is None:
        tail = " | ".join(err.strip().splitlines()[-3:])
        error = error or f"exit status {proc.returncode}" + ("" if result else ", no JSON line")
        return Sample(side, pair, workload, False, {}, {}, load, f"{error}: {tail}")
    metrics, params = _split(result)
    metrics.update(client_cpu_s=round(cpu, 2), wall_s=round(wall, 1))
    return Sample(side, pair, workload, True, metrics, params, load)


def verdict(metric: str, old: list[float], new: list[float], *, tolerance: float = 0.0
            ) -> str:
    """WORSE / better / ~ as the module says; "" for a metric not judged, "?" with fewer
    than two values a side (no spread to judge by)."""
    sign = direction(metric)
    if sign is None or not old or not new:
        return ""
    if metric.split("/")[0] in MUST_BE_ZERO:
        return "BROKEN" if any(new) else "ok" if not any(old) else "fixed"
    if len(old) < 2 or len(new) < 2:
        return "?"
    worse_by = (statistics.median(new) - statistics.median(old)) * -sign
    spread = max(max(old) - min(old), max(new) - min(new))
    margin = max(tolerance * abs(statistics.median(old)), LEAST_DIFFERENCE.get(metric, 0.0))
    if worse_by > spread and worse_by > margin:
        return "WORSE"
    if -worse_by > spread and -worse_by > margin:
        return "better"
    return "~"


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"


def render(samples: list[Sample], *, tolerance: float = 0.0) -> tuple[str, list[str]]:
    """The table, and the workloads it flags (a metric WORSE or BROKEN, or FAILED)."""
    lines: list[str] = []
    flagged_workloads = []
    for workload in dict.fromkeys(s.workload for s in samples):
        flagged = 0
        side = {name: [s for s in samples if s.workload == workload and s.side == name]
                for name in ("old", "new")}
        ok = {name: [s for s in side[name] if s.ok] for name in side}
        lines.append(f"\n{workload}  (ok: old {len(ok['old'])}/{len(side['old'])}, "
                     f"new {len(ok['new'])}/{len(side['new'])} runs)")
        failed = {name: len(side[name]) - len(ok[name]) for name in side}
        if failed["new"] > failed["old"]:
            flagged += 1
            lines.append(f"  FAILED: NEW failed {failed['new']} times, OLD {failed['old']}")
        for s in side["old"] + side["new"]:
            if not s.ok:
                lines.append(f"  {s.side} pair {s.pair}: {s.error[:300]}")
        params = {name: {json.dumps(s.params, sort_keys=True) for s in ok[name]} for name in ok}
        if params["old"] and params["new"] and params["old"] != params["new"]:
            lines.append(f"  note: the trees size it differently: old {sorted(params['old'])}"
                         f" new {sorted(params['new'])}")
        names = list(dict.fromkeys(m for s in ok["old"] + ok["new"] for m in s.metrics))
        if names:
            lines.append(f"  {'metric':<36} {'better':<6} {'old':>9} {'new':>9} {'new/old':>7}"
                         f"  {'old range':<19} {'new range':<19} {'worse':<5} verdict")
        for metric in names:
            old = [s.metrics[metric] for s in ok["old"] if metric in s.metrics]
            new = [s.metrics[metric] for s in ok["new"] if metric in s.metrics]
            judged = verdict(metric, old, new, tolerance=tolerance)
            flagged += judged in ("WORSE", "BROKEN")
            better = {1: "higher", -1: "lower", None: ""}[direction(metric)]
            ratio = (f"{statistics.median(new) / statistics.median(old):.2f}"
                     if new and old and statistics.median(old) else "-")
            lines.append(
                f"  {metric:<36} {better:<6} {_median(old):>9} {_median(new):>9} {ratio:>7}  "
                f"{_range(old):<19} {_range(new):<19} {_worse_pairs(metric, ok):<5} {judged}")
        if flagged:
            flagged_workloads.append(workload)
    return "\n".join(lines), flagged_workloads


def _worse_pairs(metric: str, ok: dict[str, list[Sample]]) -> str:
    """In how many of the pairs NEW was worse than its own OLD (the pair run minutes apart,
    so under much the same load): "3/3" with a ~ verdict is worth a second sitting."""
    sign = direction(metric)
    if sign is None:
        return ""
    by_pair = [{s.pair: s.metrics[metric] for s in ok[name] if metric in s.metrics}
               for name in ("old", "new")]
    pairs = sorted(by_pair[0].keys() & by_pair[1].keys())
    worse = sum((by_pair[1][n] - by_pair[0][n]) * -sign > 0 for n in pairs)
    return f"{worse}/{len(pairs)}"


def _median(values: list[float]) -> str:
    return _fmt(statistics.median(values)) if values else "-"


def _range(values: list[float]) -> str:
    return f"{_fmt(min(values))}-{_fmt(max(values))}" if values else "-"


def _commit(tree: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git tree"
    return head + (" (uncommitted changes)" if dirty else "")


def _load(path: Path) -> tuple[dict[str, Any], list[Sample]]:
    """A samples file's header and samples (a file cut short reads as far as it goes)."""
    header: dict[str, Any] = {}
    samples = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line the run was writing when it was stopped
        kind = record.pop("kind", None)
        if kind == "header":
            header = record
        elif kind == "sample":
            samples.append(Sample(**record))
    return header, samples


def _summary(header: dict[str, Any], samples: list[Sample], path: Path) -> str:
    """Which trees, how many pairs, how long one took, and the load they ran under."""
    walls: dict[int, float] = {}
    for s in samples:
        walls[s.pair] = walls.get(s.pair, 0.0) + s.metrics.get("wall_s", 0.0)
    loads = [s.load for s in samples]
    return "\n".join([
        f"OLD {header.get('old', '?')}", f"NEW {header.get('new', '?')}",
        f"started {header.get('started', '?')}, {header.get('cpus', '?')} CPUs; "
        f"{len(walls)} pairs, samples in {path}",
        "one pair (OLD and NEW of each workload), wall seconds: "
        + ", ".join(f"{w:.0f}" for w in walls.values())
        + " (failed runs not counted)",
        f"1-minute load average at the runs' start: {min(loads, default=0):.1f}"
        f"-{max(loads, default=0):.1f}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runpool.harness.regressions",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--old", type=Path, help="the source tree before (holds runpool/)")
    parser.add_argument("--new", type=Path, help="the source tree after")
    parser.add_argument("--dsn", help="the PostgreSQL server the bench makes its databases on")
    parser.add_argument("--pairs", type=int, default=3, help="OLD/NEW pairs per workload")
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS))
    parser.add_argument("--confirm", type=int, default=2,
                        help="pairs more for each flagged workload, judged on all its pairs")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds one bench process may take (then SIGINT, SIGKILL)")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="a relative change a WORSE must exceed too (0.05: 5 %%)")
    parser.add_argument("--out", type=Path, help="the JSON-lines file of samples (default "
                        "/tmp/regressions-<time>.jsonl)")
    parser.add_argument("--report", type=Path, help="instead: print the table of a saved file")
    parser.add_argument("--python", default=sys.executable, help="the interpreter both run")
    args = parser.parse_args(argv)
    if args.report:
        saved_header, saved = _load(args.report)
        table, flagged = render(saved, tolerance=args.tolerance)
        print(_summary(saved_header, saved, args.report) + "\n" + table)
        return 1 if flagged else 0
    if not (args.old and args.new and args.dsn):
        parser.error("--old, --new and --dsn are required (or --report FILE)")
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for name, tree in trees.items():
        if not (tree / "runpool" / "__main__.py").is_file():
            parser.error(f"--{name} {tree}: no runpool/__main__.py there")
    # A bench runs in a session of its own: stopped by `timeout` or kill, this process must
    # stop it too (run_one's KeyboardInterrupt path), or it runs on, orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started in a script's background (`cmd &` ignores SIGINT), every bench would inherit
        # the ignore: the SIGINT that stops one (_stop) would be lost, each timeout would cost
        # the whole grace, and the bench's pools and databases would be left to SIGKILL.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    out = args.out or Path(f"/tmp/regressions-{time.strftime('%Y%m%dT%H%M%S')}.jsonl")
    header = {"kind": "header", "old": f"{trees['old']} {_commit(trees['old'])}",
              "new": f"{trees['new']} {_commit(trees['new'])}", "pairs": args.pairs,
              "workloads": args.workloads, "cpus": os.cpu_count(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(json.dumps(header), file=sys.stderr, flush=True)
    samples: list[Sample] = []
    with out.open("w") as sink:
        sink.write(json.dumps(header) + "\n")
        for pair in range(1, args.pairs + 1):
            samples += _pair(args, trees, pair, args.workloads, sink)
        # A workload flagged by chance (two or three pairs on a loaded machine) rarely stays
        # flagged over more pairs: judge it again on all of them.
        for pair in range(args.pairs + 1, args.pairs + 1 + args.confirm):
            if again := render(samples, tolerance=args.tolerance)[1]:
                samples += _pair(args, trees, pair, again, sink)
    table, flagged = render(samples, tolerance=args.tolerance)
    print(_summary(header, samples, out) + "\n" + table)
    return 1 if flagged else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _pair(args: argparse.Namespace, trees: dict[str, Path], pair: int, workloads: list[str],
          sink: TextIO) -> list[Sample]:
    """OLD and NEW of each workload, each sample written to `sink` as it comes."""
    samples = []
    started = time.monotonic()
    # OLD first in odd pairs, NEW first in even ones: a run leaves work behind it (W6's
    # million-row load: dirty buffers, WAL, autovacuum), and with a fixed order the second
    # side always pays the first's (an A/A sitting had NEW's W6 claims 2x slower in 3/3 pairs).
    order = list(trees.items()) if pair % 2 else list(trees.items())[::-1]
    for workload in workloads:
        for side, tree in order:
            sample = run_one(args.python, tree, side, pair, workload, args.dsn, args.timeout)
            samples.append(sample)
            sink.write(json.dumps({"kind": "sample", **asdict(sample)}) + "\n")
            sink.flush()
            print(f"pair {pair} {workload} {side}: "
                  f"{'ok' if sample.ok else sample.error[:200]} "
                  f"wall {sample.metrics.get('wall_s', '-')} s, load {sample.load:.1f}",
                  file=sys.stderr, flush=True)
    print(f"pair {pair} ({' '.join(workloads)}) took {time.monotonic() - started:.0f} s",
          file=sys.stderr, flush=True)
    return samples

if __name__ == "__main__":
    raise SystemExit(main())
