"""The ``retrain`` command line: the local stack, dropping data, and reading run records.

Subcommands that belong to one component delegate to it (``workflows``, ``tokenize``, ``render``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from retrain import config
from retrain.contracts import RunEvent, RunEventType, SchedulerJob
from retrain.domain.runs import Evaluation, Run, RunStatus, Trigger

DEFAULT_CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stack_settings() -> config.Settings:
    """The local stack's settings: infra/'s own values (retrain_ops.deployment), RETRAIN_* on top."""
    from retrain_ops.deployment import local_settings as from_deployment

    return from_deployment()


def local_settings() -> config.Settings:
    """Settings for the local stack; says so when the stand-in trainer will only check the data."""
    from retrain_local.train import torch_available

    if not torch_available():
        _say(
            "PyTorch is not installed (pip install -e '.[train]'): the stand-in trainer checks the data "
            "instead of training"
        )
    return stack_settings()


def _ledger(settings: config.Settings) -> Any:
    from retrain import composition

    return composition.ledger(settings)


def _executions(settings: config.Settings) -> Any:
    from retrain import composition

    return composition.orchestrator(settings)


@contextlib.contextmanager
def reach(
    args: argparse.Namespace, *, running: bool, local: Callable[[], config.Settings] = stack_settings
) -> Iterator[config.Settings]:
    """The settings a command acts with, and the way there. A deployment target: its own settings, as its
    functions load them, with Google's clients and Application Default Credentials. The local stack:
    attached (``running``: one must be up), or else through the ledger its last stop kept."""
    from retrain_ops import targets

    target = targets.selected(args.target)
    if not target.local:
        _warn_of_overrides(target)
        yield target.settings()
        return
    from retrain_local.stack import attach, ledger_access

    settings = local()
    if running:
        attach(settings)
        yield settings
        return
    with ledger_access(settings):
        yield settings


def _warn_of_overrides(target: Any) -> None:
    """Say when a deployment target is reached through endpoints of the environment, not Google's."""
    from retrain_ops import targets

    overrides = targets.endpoint_overrides(target)
    if overrides:
        _say(f"target {target.name} through this environment's endpoints, not Google's: {sorted(overrides)}")


def local_only(args: argparse.Namespace) -> None:
    """Refuse a local-stack command aimed at a deployment, saying what does the same there."""
    from retrain_ops import targets

    target = targets.selected(args.target)
    if not target.local:
        s = target.settings()
        raise RuntimeError(
            f"`retrain {args.command}` works on the local stack, not on target {target.name!r}; against a "
            f"deployment, data lands with `gcloud storage cp FILE gs://{s.landing_bucket}/{s.landing_prefix}"
            f"DATASET/` and `retrain --target {target.name} run` seals it"
        )


def format_run(run: Run) -> str:
    lines = [f"run {run.run_id}  [{run.status}]"]
    for label, value in (
        ("dataset", run.dataset),
        ("trigger", run.triggered_by),
        ("snapshot", run.snapshot[:16]),
        ("objects", run.objects),
        ("documents", run.documents),
        ("tokens", run.tokens),
        ("quarantined", run.quarantined),
        ("  by reason", ", ".join(f"{k} {v}" for k, v in sorted(run.quarantine_reasons.items()))),
        *(
            (f"  object {i}", f"{q.object}: {q.reason} ({q.detail})")
            for i, q in enumerate(run.quarantined_objects, 1)
        ),
        ("nodes", run.nodes),
        ("gpu node-seconds", f"{run.gpu_node_seconds:.1f}"),
        ("gpu-hours", f"{run.gpu_hours:.3f}"),
        (
            "cost",
            "unpriced: its account step could not run"
            if run.unpriced
            else f"${run.cost_usd:.2f} of node time",
        ),
        ("priced at start", None if run.estimated_cost_usd is None else f"${run.estimated_cost_usd:.2f}"),
        ("nodes at end", run.nodes_at_end),
        ("checkpoint", run.checkpoint),
        ("eval", _eval_line(run.eval)),
        ("validated on", run.eval_set),
        (
            "lineage",
            f"its data is not in the lineage: `retrain run --retry {run.run_id}` trains it on the champion"
            if run.refused
            else None,
        ),
        ("failure", run.failure),
        ("reason", run.reason),
        ("execution", run.execution),
        ("created", run.created_at),
        ("finished", run.finished_at),
    ):
        if value not in (None, ""):
            lines.append(f"  {label:<17} {value}")
    return "\n".join(lines)


def _eval_line(verdict: Evaluation | None) -> str | None:
    if verdict is None:
        return None
    return f"{'promoted' if verdict.promoted else 'not promoted'}: {verdict.reason}"


def follow(ledger: Any, run_id: str, timeout_s: float, executions: Any = None) -> Run:
    """Print a run's progress until it ends (or the timeout passes).

    With ``executions`` (the Workflow Executions API), an execution that died without recording an
    outcome (a crash, a hard cancel) is noticed and recorded as the run's failure instead of waited on.
    """
    deadline, seen = time.monotonic() + timeout_s, None
    start = time.monotonic()
    while True:
        run = ledger.get_run(run_id)
        if run is not None:
            state = (run.status, run.tokens, run.nodes_at_end)
            if state != seen:
                extra = f" tokens={run.tokens}" if run.tokens else ""
                _say(f"run {run_id}: {run.status}{extra} (+{time.monotonic() - start:.0f}s)")
                seen = state
            if run.status.terminal and run.nodes_at_end is not None:
                return run
            if executions is not None and run.execution and not run.status.terminal:
                from retrain.ingest import record_silent_end

                if record_silent_end(ledger, executions, run):
                    return ledger.get_run(run_id)
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} did not finish within {timeout_s:.0f}s")
        time.sleep(1)


def operator_identity(cloud: bool = False) -> str:
    """Who is asking: against a deployment, the Google account of the Application Default Credentials;
    on the local stack (where no Google credentials are looked for), the local user."""
    import getpass

    if cloud:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            credentials, _ = google.auth.default()
        except DefaultCredentialsError:
            return f"{getpass.getuser()} (no Google credentials)"
        email = getattr(credentials, "service_account_email", None) or getattr(credentials, "account", "")
        if email and email != "default":
            return str(email)
    return f"{getpass.getuser()} (local)"


def cmd_cancel(args: argparse.Namespace) -> int:
    from retrain import composition
    from retrain.cancel import request_cancel
    from retrain.domain.errors import Rejected
    from retrain_ops import targets

    cloud = not targets.selected(args.target).local
    with reach(args, running=True) as settings:
        ingest = composition.ingest(settings)
        try:
            cancel = request_cancel(
                ingest.ledger,
                ingest.orchestrator,
                args.run_id,
                args.reason,
                requested_by=operator_identity(cloud),
                reap=ingest.reap,
            )
        except Rejected as e:
            raise RuntimeError(e.reason) from None
        _say(cancel.detail)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Seal pending data now, as the manual HTTP entrypoint does (the same Ingest code path)."""
    from retrain import composition

    with reach(args, running=True, local=local_settings) as settings:
        return seal_or_retry(args, composition.ingest(settings))


def seal_or_retry(args: argparse.Namespace, ingest: Any) -> int:
    """`retrain run`'s work on an Ingest: retry a run (``--retry``), or seal what is pending now."""
    if args.retry:
        from retrain.domain.errors import Rejected

        try:
            outcome = ingest.retry(args.retry)
        except Rejected as e:
            _say(f"error: {e.reason}")
            return 2
        _say(f"{outcome.action}: {outcome.run_id or ''} {outcome.detail}")
        return 0
    outcomes = ingest.seal_pending(args.dataset, Trigger.MANUAL)
    if not outcomes:
        _say("nothing pending: no run started" + _sealed_already(ingest, args.dataset))
    for o in outcomes:
        _say(f"{o.action}: {o.run_id or ''} {o.detail}")
    return 0


def _sealed_already(ingest: Any, dataset: str | None) -> str:
    """Where a dataset's data went when nothing of it is pending: a timer (the sweeper once the batch was
    quiet, the hourly seal) may have sealed it moments before, into a run that is still live."""
    if not dataset:
        return ""
    live = [s for s in RunStatus if not s.terminal]
    mine = [r for r in ingest.ledger.runs_in(*live) if r.dataset == dataset]
    return "".join(
        f"; {dataset}'s data is in run {r.run_id} ({r.status}, sealed by {r.trigger})"
        for r in sorted(mine, key=lambda r: r.created_at)
    )


def cmd_plan(args: argparse.Namespace) -> int:
    """What sealing now would train and cost, without sealing (the same Ingest the functions run)."""
    from retrain import composition
    from retrain.domain.errors import Rejected

    with reach(args, running=False) as settings:
        try:
            forecasts = composition.ingest(settings).forecast(args.dataset)
        except Rejected as e:
            _say(f"error: {e.reason}")
            return 2
    if args.json:
        print(json.dumps([f.to_dict() for f in forecasts], indent=2))
        return 0
    if not forecasts:
        print("nothing has arrived since the last seal: sealing now would train nothing")
    for f in forecasts:
        pending = (
            f" (joining pending run {f.pending_run}, {f.pending_objects} object(s) in it)"
            if f.pending_run
            else ""
        )
        cap = f" of a ${f.max_cost_usd:.2f} cap" if f.max_cost_usd else ""
        if f.budget_left_usd is not None:
            cap += f"; ${f.budget_left_usd:.2f} of the ${f.monthly_budget_usd:.2f} monthly budget left"
        print(
            f"{f.dataset}: {f.objects} new object(s), {f.bytes} bytes{pending}; {f.skipped} skipped\n"
            f"  ~{f.estimated_tokens} tokens of data; trains {f.training_tokens} tokens, "
            f"~{f.estimated_node_hours:.2f} node-hours, ~${f.estimated_cost_usd:.2f}{cap} ({f.basis})\n"
            f"  {'would run' if f.would_run else 'would not run'}: {f.reason}"
        )
    return 0


#: How long the demo waits for events the function did not take at once (redelivered 10 s, 20 s, ... /60).
REDELIVERY_WAIT_S = 120.0


def cmd_demo(args: argparse.Namespace) -> int:
    local_only(args)
    from retrain_local.landing import data_files, drop
    from retrain_local.stack import LocalStack

    # SIGTERM (timeout, CI, kill) unwinds like Ctrl-C, so the stack below is stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = local_settings()
    files = data_files([Path(args.data)])
    if not files:
        raise SystemExit(f"no data files (.txt, .jsonl, .parquet) under {args.data}")
    _say("starting from a clean local state (the ledger is kept for `retrain runs` afterwards)")
    started = datetime.now(UTC)
    with LocalStack(settings, progress=_say, fresh=True) as stack:
        ledger = _ledger(settings)
        before = {r.run_id for r in ledger.list_runs()}
        dropped = drop(settings, stack.endpoints.ingest_function, files, dataset=args.dataset, progress=_say)
        # Events the function did not take at once arrive by redelivery (Eventarc's backoff): wait for them.
        deadline = time.monotonic() + (REDELIVERY_WAIT_S if dropped.queued else 0)
        while not (new := [r for r in ledger.list_runs() if r.run_id not in before]):
            if time.monotonic() >= deadline:
                _say(
                    f"no run started: {dropped.queued} event(s) still wait for redelivery"
                    if dropped.queued
                    else "no run started: this data has trained before"
                )
                return 1
            time.sleep(0.5)
        executions = _executions(settings)
        with _showing_events(settings, started) as told:
            run = follow(ledger, new[-1].run_id, args.timeout, executions)
            told.wait_for(run)
        page = _report(settings, run, None)
        accounted = _audit_line(settings, ledger)
        refused, privileges = _iam_line(stack)
    print(json.dumps(run.to_dict(), indent=2) if args.json else format_run(run))
    _say(f"the run's report: {page}")
    _say(accounted)
    _say(privileges)
    return demo_exit_code(run, accounted, refused)


def demo_exit_code(run: Run, accounted: str, refused: int) -> int:
    """0 only when the demo's run succeeded and gave back every node, every dropped object is accounted
    for (``accounted``: :func:`_audit_line`) and the stack refused no call (``refused``); else 1."""
    ok = run.status == RunStatus.SUCCEEDED and run.nodes_at_end == 0 and accounted.startswith("audit: every")
    return 0 if ok and not refused else 1


class _EventPrinter:
    """Prints each run event as a subscriber of the run events topic receives it (``retrain events
    --follow``), from a thread of its own."""

    def __init__(self, settings: config.Settings, since: datetime) -> None:
        self.settings, self.since = settings, since
        self.seen: list[RunEvent] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._print, name="run-events", daemon=True)

    def _print(self) -> None:
        from retrain.adapters.events import read_events

        try:
            for event in read_events(self.settings.events_topic, self.since, True, stopped=self.stop.is_set):
                self.seen.append(event)
                _say(f"run event: {format_event(event)}")
        except Exception as e:  # the demo goes on without them
            _say(f"run events not shown: {e}")

    def wait_for(self, run: Run, timeout_s: float = 15) -> None:
        """Until the run's outcome has been told (it is published just after it is recorded)."""
        outcome = RunEventType(str(run.status)) if run.status.terminal else None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(
            e.run_id == run.run_id and e.type == outcome for e in self.seen
        ):
            time.sleep(0.2)


@contextlib.contextmanager
def _showing_events(settings: config.Settings, since: datetime) -> Iterator[_EventPrinter]:
    printer = _EventPrinter(settings, since)
    printer.thread.start()
    try:
        yield printer
    finally:
        printer.stop.set()
        printer.thread.join(10)


def _iam_line(stack: Any) -> tuple[int, str]:
    """The stack's IAM in one line: calls allowed and refused, grants no call used (the whole report is
    written at stop, ``iam-report.json``); and how many calls were refused."""
    from retrain_local.stack import IAM_REPORT

    guard = stack.guard
    unused = sum(len(e["unused"]) for e in guard.least_privilege().values())
    refused = len(guard.refused())
    line = (
        f"IAM: {sum(guard.used.values())} call(s) allowed, {refused} refused; {unused} grant(s) no call used "
        f"({stack.state_dir / IAM_REPORT})"
    )
    return refused, line


def _audit_line(settings: config.Settings, ledger: Any) -> str:
    """``retrain audit`` in one line: every dropped object accounted for, or how many are not."""
    from retrain.adapters import objects
    from retrain.audit import audit

    report = audit(settings, ledger, objects, settle_s=30)
    counts = ", ".join(f"{n} {account}" for account, n in report.counts().items())
    if report.findings:
        return f"audit: {len(report.findings)} object(s) not accounted for ({counts}): `retrain audit`"
    return f"audit: every object accounted for ({counts})"


def _reports(settings: config.Settings) -> Path:
    """Where report pages go unless ``--output`` says otherwise: ``reports/`` of the state folder."""
    return Path(settings.state_dir).resolve() / "reports"


def _report(settings: config.Settings, run: Run, output: str | None) -> Path:
    """Write the run's page (``retrain_ops.report``): to ``output``, or under the state folder's reports/."""
    from retrain.adapters import objects
    from retrain_ops.report import write_report

    path = Path(output) if output else _reports(settings) / f"{run.run_id}.html"
    return write_report(settings, objects, run, path)


def cmd_report(args: argparse.Namespace) -> int:
    """One run's whole life on one self-contained HTML page (it reads the run's TensorBoard events, so a
    local stack must be up)."""
    if (args.run_id is None) == (args.dataset is None):
        _say("give a run (retrain report RUN) or a dataset (retrain report --dataset D), not both")
        return 2
    with reach(args, running=True) as settings:
        if args.dataset is not None:
            return _dataset_report(settings, args.dataset, args.output)
        run = _ledger(settings).get_run(args.run_id)
        if run is None:
            _say(f"no run {args.run_id}")
            return 1
        print(_report(settings, run, args.output))
    return 0


#: How many of the latest runs (of every dataset) a dataset's page looks through.
DATASET_REPORT_RUNS = 1000


def _dataset_report(settings: config.Settings, dataset: str, output: str | None) -> int:
    """A dataset's history on one page (``retrain_ops.report.render_dataset``)."""
    from retrain.adapters import objects
    from retrain_ops.report import write_dataset_report

    runs = [r for r in _ledger(settings).list_runs(DATASET_REPORT_RUNS) if r.dataset == dataset]
    if not runs:
        _say(f"no run of dataset {dataset}")
        return 1
    path = Path(output) if output else _reports(settings) / f"dataset-{dataset}.html"
    print(write_dataset_report(settings, objects, dataset, runs, path))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """The body of ``retrain up``: run the stack until SIGTERM/SIGINT."""
    from retrain_local.stack import LocalStack

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with LocalStack(local_settings(), progress=_say, paused_jobs=set(args.pause)):
        stop.wait()
    return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stack_alive(path: Path) -> int | None:
    """The pid of the stack that wrote ``path`` when it still runs, else None."""
    from retrain_local.stack import Endpoints

    try:
        pid = Endpoints.load(path).pid
    except FileNotFoundError:
        return None
    return pid if _pid_alive(pid) else None


def _clean_up_after_a_crash(state_dir: Path) -> None:
    """Stop what a stack that died left running (recorded in its process registry)."""
    from retrain_local.processes import stop_recorded
    from retrain_local.stack import PROCESS_REGISTRY

    stopped = stop_recorded(state_dir / PROCESS_REGISTRY)
    if stopped:
        names = ", ".join(sorted({p.name.split(" ")[0] for p in stopped}))
        _say(f"stopped {len(stopped)} process(es) the stack had left running ({names})")


def cmd_up(args: argparse.Namespace) -> int:
    local_only(args)
    from retrain_local.stack import stack_file

    settings = stack_settings()
    path = stack_file(settings)
    if path.exists():
        pid = _stack_alive(path)
        if pid is not None:
            _say(f"a local stack is already up (pid {pid}, {path}); `retrain down` first")
            return 1
        _say(f"the last local stack (of {path}) is gone without stopping: cleaning up after it")
        _clean_up_after_a_crash(path.parent)
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.parent / "stack.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "retrain_ops.cli", "_serve", *(f"--pause={job}" for job in args.pause)],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.stderr.write(log.read_text()[-3000:])
            _say(f"the local stack did not come up; log: {log}")
            if proc.poll() is None:
                proc.terminate()
            return 1
        time.sleep(0.5)
    _say(f"local stack up (pid {proc.pid}); endpoints in {path}; log in {log}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the background stack, and whatever it started even if it died without stopping it."""
    local_only(args)
    from retrain_local.stack import stack_file

    path = stack_file(stack_settings())
    pid = _stack_alive(path) if path.exists() else None
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 90
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                _say(f"the stack (pid {pid}) did not stop in 90 s: stopping what it started")
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        else:
            _say("local stack stopped")
    elif path.exists():
        _say(f"the local stack (of {path}) is gone without stopping: cleaning up after it")
    else:
        _say("no local stack is running")
    _clean_up_after_a_crash(path.parent)
    path.unlink(missing_ok=True)
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    local_only(args)
    from retrain_local.landing import data_files, drop
    from retrain_local.stack import attach

    settings = stack_settings()
    ep = attach(settings)
    try:
        dropped = drop(
            settings,
            ep.ingest_function,
            data_files([Path(p) for p in args.files]),
            dataset=args.dataset,
            seal=not args.no_seal,
            progress=_say,
        )
    except ValueError as e:
        _say(f"error: {e}; nothing was dropped")
        return 2
    if dropped.queued:
        _say(f"{dropped.queued} event(s) wait for the function: they are delivered again until it answers")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    with reach(args, running=False) as settings:
        runs = _ledger(settings).list_runs(args.limit)
    if args.json:
        print(json.dumps([r.to_dict() for r in runs], indent=2))
        return 0
    print(f"{'RUN':<40} {'STATUS':<13} {'OBJECTS':>7} {'TOKENS':>10} {'NODE-S':>8} {'NODES@END':>9}  REASON")
    for r in runs:
        print(
            f"{r.run_id:<40} {r.status!s:<13} {r.objects:>7} {r.tokens:>10} {r.gpu_node_seconds:>8.1f} "
            f"{'' if r.nodes_at_end is None else r.nodes_at_end:>9}  "
            + (f"{r.failure}: " if r.failure else "")
            + (r.reason or "")
        )
    return 0


def format_event(event: RunEvent) -> str:
    """One run event as a line: when, what, which run, and what it says."""
    said = [
        f"{event.failure}: " if event.failure else "",
        event.reason or "",
        f" cost ${event.cost_usd:.2f}" if event.cost_usd is not None else "",
        f" checkpoint {event.checkpoint}" if event.checkpoint else "",
    ]
    return f"{event.time[:19]}Z {event.type!s:<13} {event.run_id:<40} {''.join(said).strip()}".rstrip()


def cmd_events(args: argparse.Namespace) -> int:
    """The run events the topic retains (the last ``--since-hours``), then, with ``--follow``, each one as
    it is published, until interrupted."""
    from datetime import timedelta

    from retrain.adapters.events import read_events

    since = datetime.now(UTC) - timedelta(hours=args.since_hours)
    with reach(args, running=False) as settings:
        try:
            for event in read_events(settings.events_topic, since, args.follow):
                if args.dataset is None or event.dataset == args.dataset:
                    print(
                        json.dumps(json.loads(event.data())) if args.json else format_event(event), flush=True
                    )
        except KeyboardInterrupt:
            pass
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with reach(args, running=False) as settings:
        run = _ledger(settings).get_run(args.run_id)
    if run is None:
        _say(f"no run {args.run_id}")
        return 1
    print(json.dumps(run.to_dict(), indent=2) if args.json else format_run(run))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Every landed object accounted for (``retrain.audit``): exit 1 when something is not."""
    from retrain.adapters import objects
    from retrain.audit import Account, audit, repair

    with reach(args, running=True) as settings:
        ledger = _ledger(settings)
        report = audit(settings, ledger, objects, args.dataset, settle_s=args.settle)
        if args.repair and report.findings:
            for e in repair(report, settings, ledger, objects):
                _say(f"repaired {e.uri}#{e.generation} ({e.account}): {e.action}")
            report = audit(settings, ledger, objects, args.dataset, settle_s=args.settle)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 1 if report.findings else 0
    counts = ", ".join(f"{n} {account}" for account, n in report.counts().items()) or "nothing"
    print(f"{len(report.entries)} object version(s): {counts}")
    for e in report.entries:
        if e.account.finding or args.verbose:
            print(f"  {e.account:<12} {e.uri}#{e.generation}  {e.detail}")
            if e.action:
                print(f"  {'':<12} -> {e.action}")
    waiting = sorted({e.run_id for e in report.entries if e.account == Account.RETURNED and e.run_id})
    for run_id in waiting:
        n = sum(1 for e in report.entries if e.account == Account.RETURNED and e.run_id == run_id)
        print(f"  {n} object(s) given back by run {run_id}: `retrain run --retry {run_id}` trains them")
    if report.findings:
        print(f"{len(report.findings)} object version(s) not accounted for (see above)")
        return 1
    print("every object is accounted for")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """What a DWS run needs, checked before anything is spent (``retrain_ops.doctor``): exit 1 on a
    failure."""
    from retrain import composition
    from retrain.adapters import objects
    from retrain.adapters.cluster import cluster_manager
    from retrain_ops.deployment import Deployment
    from retrain_ops.doctor import RestProjectApis, Verdict, examine

    with reach(args, running=True) as settings:
        cluster = cluster_manager().get_cluster(name=composition.cluster(settings).name)
        required = Deployment(project=settings.project).enabled_services()
        findings = examine(
            settings, RestProjectApis.from_environment(), cluster, objects.read_bytes, required
        )
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            print(f"{f.verdict:<8} {f.check:<23} {f.detail}")
            if f.fix and f.verdict != Verdict.PASS:
                print(f"{'':<8} {'':<23} -> {f.fix}")
    return 1 if any(f.verdict == Verdict.FAIL for f in findings) else 0


def cmd_target(args: argparse.Namespace) -> int:
    """Save, list and show the deployments the CLI can point at (``retrain_ops.targets``)."""
    from retrain_ops import targets

    if args.action == "save":
        if bool(args.from_terraform) == bool(args.env_file):
            raise ValueError("give one of --from-terraform DIR or --env-file FILE")
        env = (
            targets.from_terraform(Path(args.from_terraform))
            if args.from_terraform
            else targets.from_env_file(Path(args.env_file))
        )
        path = targets.save(args.name, env)
        _say(f"target {args.name} saved in {path}: `retrain --target {args.name} runs`")
    elif args.action == "list":
        for name in [targets.LOCAL, *targets.names()]:
            print(name)
    else:
        target = targets.load(args.name)
        print(json.dumps(target.env, indent=2, sort_keys=True))
    return 0


def _point_at(target_name: str | None) -> None:
    """Point this process (and a delegated command's ``config.load()``) at the target: a deployment's
    settings replace every RETRAIN_* setting of the environment; the local stack is attached if it runs."""
    from retrain_ops import targets

    target = targets.selected(target_name)
    if target.local:
        _attach_if_a_local_stack_runs()
        return
    _warn_of_overrides(target)
    for key in config.to_env(config.Settings()):
        os.environ.pop(key, None)
    os.environ.update(target.env)


#: Subcommands that belong to one component: (module whose main(argv) runs it, help).
DELEGATES = {
    "workflows": ("cloudworkflows.cli", "run workflow files in retrain's Workflows interpreter"),
    "tokenize": ("retrain_tokenize.cli", "tokenize text into Megatron .bin/.idx datasets"),
    "render": ("retrain_ops.render", "render Kubernetes manifests (render jobset ...)"),
    "notify": ("retrain.k8s.notifier", "publish JobSet terminal states to Pub/Sub (runs in the cluster)"),
    "reap": (
        "retrain_ops.reap",
        "delete JobSets and capacity requests of no live run; report GPU nodes up",
    ),
    "deploy": ("retrain_ops.deploy", "plan and apply the Terraform stages (bootstrap, platform, app)"),
    "pin": (
        "retrain_ops.pins",
        "pin the third-party images and manifests the deployment uses (infra/pins.json)",
    ),
}


#: Delegated commands that work on the local stack as on a deployment: pointed at the stack when one runs.
LOCAL_AWARE = ("reap",)


def _split_target(argv: list[str]) -> tuple[str | None, list[str]]:
    """A leading ``--target NAME`` (or ``--target=NAME``), and the rest of the command line."""
    if argv and argv[0] == "--target":
        if len(argv) < 2:
            raise SystemExit("retrain: --target needs a name")
        return argv[1], argv[2:]
    if argv and argv[0].startswith("--target="):
        return argv[0].split("=", 1)[1], argv[1:]
    return None, argv


def _attach_if_a_local_stack_runs() -> None:
    from retrain_local.stack import attach, stack_file

    settings = stack_settings()
    if stack_file(settings).exists() and _stack_alive(stack_file(settings)) is not None:
        attach(settings)
        for key, value in config.to_env(settings).items():
            os.environ.setdefault(key, value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="retrain", description=__doc__)
    p.add_argument(
        "--target",
        metavar="NAME",
        help="where to act: `local` (the local stack, the default) or a saved deployment "
        "(`retrain target list`); default $RETRAIN_TARGET",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="start the local stack, drop data, follow the run to the end")
    d.add_argument("--data", default=str(DEFAULT_CORPUS), help="folder of .txt/.jsonl/.parquet files")
    d.add_argument("--dataset", default=None, help="dataset name (default: the configured one)")
    d.add_argument("--timeout", type=float, default=1200, help="seconds to wait for the run")
    d.add_argument("--json", action="store_true", help="print the run record as JSON")
    d.set_defaults(fn=cmd_demo)

    up = sub.add_parser("up", help="start the local stack in the background")
    up.set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop the background local stack").set_defaults(fn=cmd_down)
    serve = sub.add_parser("_serve")  # the body of `up`; no help: not listed
    serve.set_defaults(fn=cmd_serve)
    for stack_command in (up, serve):
        stack_command.add_argument(
            "--pause",
            action="append",
            default=[],
            choices=[job.value for job in SchedulerJob],
            metavar="JOB",
            help="a Scheduler job (seal, sweeper, reaper, audit) that does not tick, as after "
            "`gcloud scheduler jobs pause`: a quiet stack for work that must not race a timer",
        )

    dr = sub.add_parser("drop", help="upload files to the landing bucket (local stack) and seal")
    dr.add_argument("files", nargs="+")
    dr.add_argument("--dataset", default=None)
    dr.add_argument("--no-seal", action="store_true", help="do not drop the seal marker after the files")
    dr.set_defaults(fn=cmd_drop)

    r = sub.add_parser("runs", help="list run records")
    r.add_argument("--json", action="store_true")
    r.add_argument("--limit", type=int, default=100)
    r.set_defaults(fn=cmd_runs)

    ev = sub.add_parser(
        "events", help="the run events (state changes, promotions) of the last day, or --follow"
    )
    ev.add_argument("--follow", action="store_true", help="then print each one as it is published")
    ev.add_argument("--dataset", default=None, help="only this dataset's runs")
    ev.add_argument("--since-hours", type=float, default=24.0, help="how far back to start (default: 24)")
    ev.add_argument("--json", action="store_true", help="each event's data as one JSON line")
    ev.set_defaults(fn=cmd_events)

    st = sub.add_parser("status", help="show one run record")
    st.add_argument("run_id")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)

    rn = sub.add_parser("run", help="seal pending data now and start its run (manual trigger)")
    rn.add_argument("--dataset", default=None, help="only this dataset (default: every dataset with data)")
    rn.add_argument("--retry", metavar="RUN", help="run a failed or cancelled run's objects again")
    rn.set_defaults(fn=cmd_run)

    pl = sub.add_parser("plan", help="what sealing now would train and cost (changes nothing)")
    pl.add_argument("--dataset", default=None, help="only this dataset (default: every dataset with data)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    rp = sub.add_parser("report", help="one run's timeline, loss curve, cost and lineage as one HTML page")
    rp.add_argument("run_id", nargs="?", default=None)
    rp.add_argument("--dataset", default=None, help="instead: the dataset's runs, champion chain and lineage")
    rp.add_argument("--output", default=None, help="file to write (default: .retrain/reports/RUN.html)")
    rp.set_defaults(fn=cmd_report)

    c = sub.add_parser("cancel", help="stop a run; its GPUs are released and it ends as cancelled")
    c.add_argument("run_id")
    c.add_argument("--reason", default="cancelled by request")
    c.set_defaults(fn=cmd_cancel)

    dc = sub.add_parser("doctor", help="check what a DWS run needs (APIs, GPU quota, GKE, images) first")
    dc.add_argument("--json", action="store_true")
    dc.set_defaults(fn=cmd_doctor)

    au = sub.add_parser("audit", help="account for every landed object against the ledger (exit 1: not all)")
    au.add_argument("--dataset", default=None, help="only this dataset (default: every one)")
    au.add_argument("--json", action="store_true")
    au.add_argument("--repair", action="store_true", help="do what each mechanical finding's action says")
    au.add_argument("--verbose", action="store_true", help="list every object version, not only findings")
    au.add_argument(
        "--settle", type=float, default=0.0, help="seconds a finding must hold (work in flight settles)"
    )
    au.set_defaults(fn=cmd_audit)

    t = sub.add_parser("target", help="save, list or show the deployments the CLI can act on")
    t_sub = t.add_subparsers(dest="action", required=True)
    ts = t_sub.add_parser("save", help="save a deployment's settings (the app stage's retrain_env output)")
    ts.add_argument("name")
    ts.add_argument("--from-terraform", metavar="DIR", help="the applied app stage, e.g. infra/app")
    ts.add_argument(
        "--env-file", metavar="FILE", help="KEY=VALUE lines or a JSON object of RETRAIN_* settings"
    )
    t_sub.add_parser("list", help="the known targets")
    tw = t_sub.add_parser("show", help="a target's settings")
    tw.add_argument("name")
    t.set_defaults(fn=cmd_target)

    for name, (_, helptext) in DELEGATES.items():
        sub.add_parser(name, help=helptext, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    target, rest = _split_target(argv)
    if rest and rest[0] in DELEGATES:
        import importlib

        try:
            if rest[0] in LOCAL_AWARE:
                _point_at(target)
            elif target is not None:
                raise ValueError(f"`retrain {rest[0]}` takes no --target")
        except (RuntimeError, ValueError) as e:
            _say(f"error: {e}")
            return 1
        return int(importlib.import_module(DELEGATES[rest[0]][0]).main(rest[1:]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (RuntimeError, FileNotFoundError, TimeoutError, ValueError) as e:
        _say(f"error: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
