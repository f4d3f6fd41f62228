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
Other processes on the machine are counted too (as ``other``): run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    seen: dict[str, list[object]] = {}
    sample(seen)
    before = {k: float(v[0]) for k, v in seen.items()}  # what ran before the command counts from here
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(args.every):
            sample(seen)

    thread = threading.Thread(target=sampler, daemon=True)
    started = time.monotonic()
    thread.start()
    code = subprocess.call(command)
    wall = time.monotonic() - started
    done.set()
    thread.join()
    sample(seen)
    by_kind: Counter[str] = Counter()
    for key, (cpu, cmd) in seen.items():
        by_kind[kind_of(str(cmd))] += float(cpu) - before.get(key, 0.0)  # type: ignore[arg-type]
    total = sum(by_kind.values())
    cores = os.cpu_count() or 1
    print(f"\n{' '.join(command)}: exit {code}, {wall:.0f} s wall on {cores} cores")
    print(f"{'kind of process':58} {'CPU s':>8} {'share':>6}")
    for name, cpu in by_kind.most_common():
        print(f"{name:58} {cpu:8.0f} {cpu / total:6.1%}")
    print(f"{'all':58} {total:8.0f}")
    baseline = wall * cores
    print(f"baseline: {baseline:.0f} CPU s the machine could give in that time; used {total / baseline:.0%}")
    if args.json:
        figures = {"wall_s": wall, "cores": cores, "cpu_s": dict(by_kind), "exit": code}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
