"""Nothing is lost, at the scale and with the interleavings users make: a folder synced twice by many
droppers at once, and seeded random interleavings of drops, re-drops, changes, deletes and seals from
every trigger while runs end every way.  Through the whole local stack; each test ends with the audit.

A failing interleaving names its seed in the test id; ``RETRAIN_STRESS_SEEDS=7,8 pytest
tests/test_nothing_lost.py -k interleavings`` replays (or widens) it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from stack_support import assert_accounted, assert_nothing_left, module_stack, new_dataset

from retrain import composition
from retrain.adapters import objects
from retrain.adapters.ledger import FirestoreLedger
from retrain.adapters.workflows import WorkflowsExecutions
from retrain.audit import Account, audit
from retrain.cancel import request_cancel
from retrain.contracts import RunManifest
from retrain.domain.errors import Rejected
from retrain.domain.runs import BatchState, Run, RunStatus
from retrain.ingest import Ingest
from retrain_local.cluster import Faults
from retrain_local.landing import drop
from retrain_local.stack import LocalStack
from retrain_ops.cli import operator_identity

pytestmark = [pytest.mark.e2e, pytest.mark.emulators, pytest.mark.envtest]

#: Longer than both syncs of a folder take (each phase's deadline is 300 s without progress).
HOLD_TRAINING_S = 3600.0

STRESS_SEEDS = [int(s) for s in os.environ.get("RETRAIN_STRESS_SEEDS", "1,2").split(",") if s.strip()]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # With the stack's own stuck_after_s: on two shared cores a start can outlast it, and a sweep then
    # starts the run too; the slow start's execution ends at its begin step (the run has one execution).
    yield from module_stack(tmp_path_factory)


@pytest.fixture(autouse=True)
def healthy_twin(stack: LocalStack) -> None:
    stack.twin.faults = Faults()


def content_hash(body: bytes) -> str:
    """The content hash a JSONL object's arrival gets (its md5, as GCS gives it, and its format)."""
    return f"md5:{base64.b64encode(hashlib.md5(body).digest()).decode()}:jsonl"


def synced_folder(folder: Path, rng: random.Random) -> list[Path]:
    """The issue's folder: 200 JSONL files of about 7 KB, 179 distinct contents (22 files are empty)."""
    folder.mkdir(parents=True)
    words = " ".join(f"w{rng.randrange(5000)}" for _ in range(20000)).split()
    files = []
    for i in range(200):
        lines = (
            []
            if i % 9 == 0 and i < 198
            else [json.dumps({"text": " ".join(rng.choice(words) for _ in range(90))}) for _ in range(12)]
        )
        path = folder / f"f{i:03d}.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        files.append(path)
    return files


def drop_concurrently(stack: LocalStack, files: list[Path], dataset: str, droppers: int) -> int:
    """At most ``droppers`` concurrent `retrain drop` calls, each taking an equal share of the files and
    sealing; how many drops were made (200 files in shares of 7 make 29 drops for 32 droppers).  An
    event the function did not take at once (a seal contending with 28 others on two loaded cores can
    outlast the delivery's 60 s) is redelivered, as Eventarc does: this returns once every one has been."""
    share = -(-len(files) // droppers)
    chunks = [files[i : i + share] for i in range(0, len(files), share)]
    before = stack.redelivery.delivered
    with ThreadPoolExecutor(len(chunks)) as pool:
        done = [
            pool.submit(drop, stack.settings, stack.endpoints.ingest_function, chunk, dataset=dataset)
            for chunk in chunks
        ]
        queued = sum(d.result().queued for d in done)
    wait_for_redelivery(stack, before + queued)
    return len(chunks)


def wait_for_redelivery(stack: LocalStack, delivered: int) -> None:
    """Until the stack's redelivery has delivered ``delivered`` events in all.  Redelivery is one event
    after another, each waiting up to the function's answer: on two loaded cores 58 of them once took
    longer than 300 s in all.  What fails is a delivery loop that stalls."""
    progress, stalled_at = stack.redelivery.delivered, time.monotonic() + 300
    while stack.redelivery.delivered < delivered:
        if stack.redelivery.delivered > progress:
            progress, stalled_at = stack.redelivery.delivered, time.monotonic() + 300
        assert time.monotonic() < stalled_at, f"{delivered - progress} event(s) not redelivered in 300 s"
        time.sleep(0.5)


def runs_of(stack: LocalStack, dataset: str, ledger: FirestoreLedger | None = None) -> list[Run]:
    """The dataset's runs; a wait that asks every second passes its ``ledger`` (one client and channel
    for the whole wait, not one a poll)."""
    ledger = ledger or FirestoreLedger(stack.settings.project)
    return [r for r in ledger.list_runs(1000) if r.dataset == dataset]


def settled(stack: LocalStack, dataset: str, timeout_s: float = 600) -> list[Run]:
    """The dataset's runs once nothing of it waits or runs, and it stayed so for a quiet period (a sweep
    ticks in it): no arrival since its last seal, no seal still joining its batch to a run, and every run
    ended, its execution done (a failed run's finish step gives its content back after the record's end)
    and its content given back if it did not succeed.  Each is a fact the ledger or the executions hold,
    not a timer: this once waited three quiet periods of nothing, ten seconds more a settle."""
    ledger = FirestoreLedger(stack.settings.project)
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while True:
        runs = runs_of(stack, dataset, ledger)
        busy = (
            bool(ledger.pending(dataset))
            or any(not r.status.terminal or executing(stack, r) for r in runs)
            or any(r.dataset == dataset for r in ledger.unsettled())
            or any(b.get("dataset") == dataset for b in ledger.batches_in(BatchState.SEALED))
        )
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > stack.settings.quiet_period_s:
            return runs
        assert time.monotonic() < deadline, (
            f"dataset {dataset} did not settle: {[(r.run_id, r.status) for r in runs]}"
        )
        time.sleep(1)


def executing(stack: LocalStack, run: Run) -> bool:
    """Whether the run's workflow execution is still running (one the test made vanish is not)."""
    if not run.execution:
        return False
    try:
        return bool(stack.executions.get(run.execution)["state"] == "ACTIVE")
    except KeyError:
        return False


def trained_contents(stack: LocalStack, runs: list[Run]) -> Counter[str]:
    """Each content hash, counted once per run that succeeded reading it (its manifest, less what it set
    aside whole)."""
    counts: Counter[str] = Counter()
    for run in runs:
        if run.status != RunStatus.SUCCEEDED:
            continue
        uri = f"{stack.settings.artifacts_uri}/runs/{run.run_id}/objects.json"
        unread = {q.version for q in run.quarantined_objects}
        for v in RunManifest.parse(objects.read_bytes(uri)).objects:
            if (v.uri, v.generation) not in unread:
                counts[v.content_hash] += 1
    return counts


@pytest.mark.long
@pytest.mark.timeout(2100)  # two phases of drops and redelivery (600 s each), then settling (600 s at most)
@pytest.mark.parametrize("droppers", [8, 32])
def test_a_folder_synced_twice_trains_every_content_once(
    stack: LocalStack, tmp_path: Path, droppers: int
) -> None:
    """200 files (179 distinct contents) dropped by concurrent droppers, each sealing; then the same files
    again under the same names (new generations, identical bytes): every distinct content trains exactly
    once, in at most two runs (the first seal's, and one for all that was sealed while it trained), and no
    run fails.

    The first run trains until both syncs were delivered (the twin holds its pods): a run ends in under a
    minute on a fast machine, sooner than 32 droppers and their redeliveries finish, and a run that ended
    mid-sync rightly started another for what had been sealed by then (three runs, seen in a full run)."""
    files = synced_folder(tmp_path / "folder", random.Random(droppers))
    expected = {content_hash(f.read_bytes()) for f in files}
    assert len(expected) == 179
    dataset = new_dataset()
    stack.twin.faults = Faults(hold_training_s=HOLD_TRAINING_S)
    drops = drop_concurrently(stack, files, dataset, droppers)
    drops += drop_concurrently(stack, files, dataset, droppers)  # the folder synced again
    held = runs_of(stack, dataset)
    assert not [r for r in held if r.status.terminal], held  # no run ended during the syncs
    stack.twin.faults = Faults()  # the first run's pods end now
    runs = settled(stack, dataset)
    assert 1 <= len(runs) <= 2 and [r.status for r in runs] == [RunStatus.SUCCEEDED] * len(runs), runs
    assert sum(r.objects for r in runs) == 179 and all(r.quarantined_objects == [] for r in runs)
    trained = trained_contents(stack, runs)
    assert set(trained) == expected and set(trained.values()) == {1}
    report = audit(stack.settings, FirestoreLedger(stack.settings.project), objects, dataset)
    assert report.counts() == {"duplicate": 221, "marker": drops, "trained": 179}  # a seal per drop


# --- seeded random interleavings ----------------------------------------------------------------------

ENDINGS = ("succeed", "fail", "cancel", "lost")
FAILURES = (Faults(provisioning="fail"), Faults(crash_pods_always=True), Faults(provisioning="never"))


class Interleavings:
    """One seeded scenario on one dataset: the bucket as the droppers left it, and the ways to act."""

    def __init__(self, stack: LocalStack, tmp_path: Path, seed: int) -> None:
        self.stack, self.rng, self.tmp = stack, random.Random(seed), tmp_path
        self.dataset = f"stress{seed}-{uuid.uuid4().hex[:6]}"
        self.ingest: Ingest = composition.ingest(stack.settings)
        self.bodies = [self._body() for _ in range(40)] + [b""]  # some content shared between names
        self.names = [f"o{i:03d}.jsonl" for i in range(120)]
        self.dropped: set[str] = set()
        self.queued: list[int] = []  # each drop's events the function did not take at once (redelivered)

    def _body(self) -> bytes:
        return "".join(json.dumps({"text": f"{uuid.uuid4()} " * 20}) + "\n" for _ in range(3)).encode()

    def uri(self, name: str) -> str:
        s = self.stack.settings
        return f"gs://{s.landing_bucket}/{s.landing_prefix}{self.dataset}/{name}"

    def _drop(self, plan: list[tuple[str, bytes | None]], seal: bool) -> None:
        """Drop each name with its bytes (None: the bytes it holds now again, a new generation)."""
        folder = self.tmp / uuid.uuid4().hex
        folder.mkdir()
        files = []
        for name, body in plan:
            if body is None:
                try:
                    body = objects.read_bytes(self.uri(name))
                except FileNotFoundError:  # deleted by a burst running beside this one
                    continue
            path = folder / name
            path.write_bytes(body)
            files.append(path)
        if files:
            dropped = drop(
                self.stack.settings,
                self.stack.endpoints.ingest_function,
                files,
                dataset=self.dataset,
                seal=seal,
            )
            self.queued.append(dropped.queued)  # bursts drop side by side: one list.append each
        self.dropped.update(name for name, _ in plan)

    def _new_bytes(self) -> bytes:
        return self._body() if self.rng.random() < 0.5 else self.rng.choice(self.bodies)

    def actions(self) -> list[Callable[[], None]]:
        """A random burst, planned here from the seed (run concurrently): new files, identical re-drops,
        changed bytes under the same names, deletes."""
        out: list[Callable[[], None]] = []
        for _ in range(self.rng.randrange(4, 9)):
            kind = self.rng.choice(("new", "new", "redrop", "change", "delete", "purge"))
            existing = sorted(self.dropped)
            seal = self.rng.random() < 0.5
            if kind == "new" or not existing:
                names = self.rng.sample(self.names, self.rng.randrange(3, 12))
                plan = [(n, None if n in self.dropped else self._new_bytes()) for n in names]
            elif kind in ("redrop", "change"):
                names = self.rng.sample(existing, min(len(existing), self.rng.randrange(1, 10)))
                plan = [(n, None if kind == "redrop" else self._new_bytes()) for n in names]
            else:
                names = self.rng.sample(existing, min(len(existing), self.rng.randrange(1, 4)))
                out.append(lambda n=names, every=kind == "purge": self._delete(n, every))
                continue
            self.dropped.update(names)
            out.append(lambda p=plan, sealed=seal: self._drop(p, sealed))
        return out

    def _delete(self, names: list[str], every_version: bool) -> None:
        """Delete each name's live version (the versioned bucket keeps it, noncurrent: what arrived still
        trains), or, ``every_version``, each of its versions (withdrawn for good: nothing left to read)."""
        bucket = objects.storage_client().bucket(self.stack.settings.landing_bucket)
        for name in names:
            path = objects.split_gs(self.uri(name))[1]
            versions = [b.generation for b in bucket.list_blobs(prefix=path, versions=True) if b.name == path]
            for generation in versions if every_version else [None]:
                with contextlib.suppress(Exception):  # deleted already, by a burst running beside this one
                    bucket.blob(path, generation=generation).delete()

    def seal(self) -> None:
        """A seal from one of the triggers a deployment has: a manual run, a Scheduler tick, the sweeper
        once the batch is quiet (a marker comes with the drops themselves)."""
        how = self.rng.choice(("manual", "scheduler", "sweeper"))
        if how == "manual":
            self.ingest.seal_pending(self.dataset, "manual")
        elif how == "scheduler":
            self.ingest.on_scheduler_tick({"job": "seal", "dataset": self.dataset})
        else:
            time.sleep(self.stack.settings.quiet_period_s + 1)
            self.ingest.sweep()

    def end_the_live_run(self, ending: str) -> None:
        """Cancel the dataset's run in training, or make its execution vanish; once it has ended, later
        runs train at once again (the held training kept it live for the cancel)."""
        s = self.stack.settings
        ledger = FirestoreLedger(s.project)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            runs = runs_of(self.stack, self.dataset, ledger)
            live = [r for r in runs if r.status == RunStatus.TRAINING]
            if live:
                break
            if not [r for r in runs if not r.status.terminal]:
                return  # nothing new reached a run: nothing to end
            time.sleep(0.5)
        else:
            return
        (run,) = live
        if ending == "cancel":
            executions = WorkflowsExecutions(s.project, s.region, s.workflow)
            request_cancel(
                ledger, executions, run.run_id, f"stress {ending}", requested_by=operator_identity()
            )
        else:
            assert run.execution
            self.stack.executions.forget(run.execution)
        while (now := ledger.get_run(run.run_id)) is not None and not now.status.terminal:
            assert time.monotonic() < deadline + 180, now
            time.sleep(0.5)
        self.stack.twin.faults = Faults()

    def epoch(self, ending: str) -> None:
        faults = self.rng.choice(FAILURES) if ending == "fail" else Faults()
        if ending in ("cancel", "lost"):
            faults = Faults(hold_training_s=60)
        self.stack.twin.faults = faults
        before, self.queued = self.stack.redelivery.delivered, []
        with ThreadPoolExecutor(4) as pool:
            for done in [pool.submit(a) for a in self.actions()]:
                done.result()
        wait_for_redelivery(self.stack, before + sum(self.queued))
        self.seal()
        if ending in ("cancel", "lost"):
            self.end_the_live_run(ending)
        settled(self.stack, self.dataset)

    def retry_until_trained(self) -> None:
        """Healthy again: retry what every failed run gave back, until nothing waits for a retry."""
        self.stack.twin.faults = Faults()
        s = self.stack.settings
        for _ in range(6):
            report = audit(s, FirestoreLedger(s.project), objects, self.dataset)
            waiting = sorted({e.run_id for e in report.entries if e.account == Account.RETURNED and e.run_id})
            if not waiting:
                return
            for run_id in waiting:
                try:
                    self.ingest.retry(run_id)
                except Rejected:  # retried already through another of its objects' content
                    continue
            settled(self.stack, self.dataset)
        raise AssertionError(f"content still waits for a retry after six rounds: {waiting}")


@pytest.mark.long
@pytest.mark.timeout(1500)  # some 8 minutes alone; more beside other tests on two cores
@pytest.mark.parametrize("seed", STRESS_SEEDS, ids=lambda s: f"seed={s}")
def test_random_interleavings_lose_nothing(stack: LocalStack, tmp_path: Path, seed: int) -> None:
    """Bursts of concurrent drops, identical re-drops, changed bytes, deletes and purges (every version)
    under the same names, seals from every trigger, and one epoch per way a run ends (succeeded, failed,
    cancelled, its execution lost): once failed runs are retried, every object is trained (into the
    lineage, or by a run whose checkpoint the eval gate refused: trained, kept, and left to an operator's
    retry), a duplicate, gone before it could be read or set aside; no content trained twice; no node
    left."""
    scenario = Interleavings(stack, tmp_path, seed)
    endings = list(ENDINGS)
    scenario.rng.shuffle(endings)
    for ending in endings:
        scenario.epoch(ending)
        assert_accounted(stack, settle_s=30)
    scenario.retry_until_trained()
    runs = settled(stack, scenario.dataset)
    print(f"\nstress seed {seed}: endings {endings}; runs {Counter(str(r.status) for r in runs)}")
    trained = trained_contents(stack, runs)
    assert trained and max(trained.values()) == 1, [h for h, n in trained.items() if n > 1]
    report = audit(stack.settings, FirestoreLedger(stack.settings.project), objects, scenario.dataset)
    final = {
        Account.TRAINED,
        Account.REFUSED,
        Account.DUPLICATE,
        Account.WITHDRAWN,
        Account.MARKER,
        Account.SET_ASIDE,
    }
    left = [
        f"{e.account} {e.uri}#{e.generation} {e.run_id} ({e.detail})"
        for e in report.entries
        if e.account not in final
    ]
    assert not left, f"{report.counts()}: " + "; ".join(left)
    deadline = time.monotonic() + 120
    while stack.twin.node_names():  # a lost run's node goes once the reaper released it
        assert time.monotonic() < deadline, stack.twin.node_names()
        time.sleep(1)
    assert_nothing_left(stack)
