"""Where a command's CPU goes, by kind of process: what to make cheaper for a faster test suite.

    python bench/suite_cpu.py [--every 1.0] [--json OUT] -- COMMAND [ARGS...]
    python bench/suite_cpu.py -- ./scripts/test -q            # the whole suite
    python bench/suite_cpu.py -- ./scripts/test -q tests/test_e2e.py

It runs COMMAND and samples every process on the machine (``/proc``) every ``--every`` seconds, each one's
user + system CPU seconds and its command line, kept from its first sample (a process that has exited
shows none).  At the end it prints the CPU seconds of each kind of process (the emulators, the API server,
the function servers, the training pods, the Dataflow jobs, the test workers...) and its share, the
command's wall time, and the baseline: the CPU the machine could give in that time (wall x cores).  A
share near 100% of the baseline means the suite waits on CPU, not on timers: fewer CPU seconds is then
the way to a shorter run.  A process shorter than one period may be missed; the figures are lower bounds.
Other processes on the machine are counted too (as ``other``): run it on a quiet machine; the command's
own process tree is also counted exactly, from the kernel's account of its children (``getrusage``).

The same work costs more CPU seconds in a slow hour (a shared machine: the same suite at the same commit
spent 1,502 CPU s in one hour and 1,951 in another, every kind of process alike), so it also times a fixed
piece of Python work before and after COMMAND, and prints COMMAND's CPU in units of it, and the CPU the
hypervisor gave other guests meanwhile (``steal``, /proc/stat): compare runs of different hours by these.

It also prints how busy the whole machine was, minute by minute (/proc/stat): a suite whose minutes are all
near 100% is shortened only by fewer CPU seconds, and the minutes well below it say when it waited instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

#: Kinds of process, by a pattern of their command line: the first that matches names it.
KINDS = (
    ("Firestore emulator", r"cloud-firestore-emulator"),
    ("Pub/Sub emulator", r"pubsub-emulator|cloud-pubsub-emulator"),
    ("BigQuery emulator", r"bqemulator"),
    ("Cloud Storage emulator", r"gcs_emulator|gcp-storage-emulator|storage_emulator"),
    ("kube-apiserver", r"kube-apiserver"),
    ("etcd", r"\betcd\b"),
    ("function servers (functions-framework)", r"functions_framework|functions-framework"),
    # before the training pods: a job forked from its fork server shows the server's command line
    ("Dataflow jobs (dataflow/main.py, Beam)", r"dataflow/main\.py|retrain_tokenize|sdk_worker"),
    (
        "training pods (torchrun, stand-in trainers)",
        r"torchrun|pt_elastic|retrain_local\.(train|forkserver)|standin",
    ),
    ("background stack (retrain up)", r"_serve\b"),
    ("retrain commands", r"bin/retrain\b|retrain_ops\.cli|-m retrain\b"),
    ("test workers (pytest-xdist: tests and in-process stacks)", r"exec\(eval\(sys\.stdin|execnet"),
    ("pytest", r"pytest"),
    ("terraform, checkov", r"terraform|checkov"),
    ("linters, type checker, set-up", r"\bruff\b|\bmypy\b|pip install|\buv\b"),
    ("Java (other)", r"\bjava\b"),
    ("Python (other)", r"python"),
)


def kind_of(command: str) -> str:
    return next((name for name, pattern in KINDS if re.search(pattern, command)), "other")


def sample(seen: dict[str, list[object]]) -> None:
    """Each process's CPU seconds now, and its command line as first seen (pid and start time as key)."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        key = f"{pid}:{fields[19]}"
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if key in seen:
            seen[key][0] = cpu
        elif command.strip():  # a process already gone (a zombie) has none: it was sampled before, or missed
            seen[key] = [cpu, command]


def reference_cpu_s(repeat: int = 5) -> float:
    """CPU seconds of a fixed piece of work (hashing, an interpreter loop, JSON: what the suite's Python
    processes do), the fastest of ``repeat`` runs: the machine's speed this hour (a slower run met a
    neighbour)."""
    times = []
    for _ in range(repeat):
        started = time.process_time()
        digest, block = hashlib.sha256(), bytes(1 << 20)
        for _ in range(192):
            digest.update(block)
        total = 0
        for i in range(6_000_000):
            total += i % 7
        json.loads(json.dumps([{"k": i, "v": str(i)} for i in range(300_000)]))
        times.append(time.process_time() - started)
    return min(times)


def cpu_ticks() -> list[int]:
    """The machine's CPU time since boot, all cores, in clock ticks: /proc/stat's first line (user, nice,
    system, idle, iowait, irq, softirq, steal)."""
    return [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def steal_s() -> float:
    """CPU seconds the hypervisor gave other guests since boot, all cores (/proc/stat's 8th column)."""
    return cpu_ticks()[7] / os.sysconf("SC_CLK_TCK")


def busy_and_total() -> tuple[int, int]:
    """The machine's busy and total CPU ticks since boot (:func:`cpu_ticks`): all but idle and iowait;
    steal counts as busy (another guest had the core)."""
    ticks = cpu_ticks()
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def busy_by_minute(marks: list[tuple[float, int, int]]) -> list[int]:
    """The busy share (percent) of each whole minute between the first and last of ``marks`` (monotonic
    time, busy and total ticks), then of the part-minute left at the end if it is 5 s or more (or is all
    there is)."""
    shares: list[int] = []
    start = marks[0]
    for i, mark in enumerate(marks[1:], 1):
        last, span = i == len(marks) - 1, mark[0] - start[0]
        if span >= 60 or (last and (span >= 5 or not shares)):
            if mark[2] > start[2]:
                shares.append(round(100 * (mark[1] - start[1]) / (mark[2] - start[2])))
            start = mark
    return shares


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    reference_before, steal_before = reference_cpu_s(), steal_s()
    seen: dict[str, list[object]] = {}
    sample(seen)
    before = {k: float(v[0]) for k, v in seen.items()}  # what ran before the command counts from here
    done = threading.Event()
    marks = [(time.monotonic(), *busy_and_total())]

    def sampler() -> None:
        while not done.wait(args.every):
            sample(seen)
            marks.append((time.monotonic(), *busy_and_total()))

    thread = threading.Thread(target=sampler, daemon=True)
    started = time.monotonic()
    thread.start()
    code = subprocess.call(command)
    wall = time.monotonic() - started
    # the command's own process tree, exactly (every descendant its parent waited for), where the samples
    # below also count whatever else ran on the machine meanwhile
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = children.ru_utime + children.ru_stime
    done.set()
    thread.join()
    sample(seen)
    marks.append((time.monotonic(), *busy_and_total()))
    busy = busy_by_minute(marks)
    steal = steal_s() - steal_before
    reference_after = reference_cpu_s()
    reference = (reference_before + reference_after) / 2
    by_kind: Counter[str] = Counter()
    for key, (cpu, cmd) in seen.items():
        by_kind[kind_of(str(cmd))] += float(cpu) - before.get(key, 0.0)  # type: ignore[arg-type]
    total = sum(by_kind.values())
    cores = os.cpu_count() or 1
    print(f"\n{' '.join(command)}: exit {code}, {wall:.0f} s wall on {cores} cores")
    print(f"{'kind of process':58} {'CPU s':>8} {'share':>6}")
    for name, cpu in by_kind.most_common():
        print(f"{name:58} {cpu:8.0f} {cpu / total:6.1%}")
    print(f"{'all':58} {total:8.0f}  (the command's own processes {own:.0f})")
    baseline = wall * cores
    print(f"baseline: {baseline:.0f} CPU s the machine could give in that time; used {total / baseline:.0%}")
    print(
        f"machine busy, minute by minute (%): {' '.join(map(str, busy))}; "
        f"{sum(b >= 90 for b in busy)} of {len(busy)} minutes at 90% or more"
    )
    print(
        f"machine: the reference work took {reference_before:.2f} CPU s before the command and "
        f"{reference_after:.2f} after; the command took {total / reference:.0f} of it; "
        f"steal {steal:.0f} CPU s"
    )
    if args.json:
        figures = {
            "wall_s": wall,
            "cores": cores,
            "cpu_s": dict(by_kind),
            "exit": code,
            "command_cpu_s": own,
            "reference_cpu_s": reference,
            "steal_s": steal,
            "busy_by_minute": busy,
        }
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
