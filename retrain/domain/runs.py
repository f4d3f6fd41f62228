"""Batches and runs: what a run is, the states it moves through, and a snapshot's identity.

A batch collects arrivals for one dataset until it is sealed; a sealed batch becomes exactly one run
unless its snapshot (the hash of its objects' content hashes) has trained before.  The run record is
what every later reader (the CLI, the reaper, a person) relies on, so its fields are fixed here.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class RunStatus(StrEnum):
    PENDING = "pending"
    TOKENIZING = "tokenizing"
    PROVISIONING = "provisioning"
    TRAINING = "training"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


class Trigger(StrEnum):
    """What sealed a run's first batch (:attr:`Run.trigger`)."""

    GCS_MARKER = "gcs-marker"
    """The seal marker object (``seal_marker``) landed under the dataset's prefix."""
    SCHEDULER = "scheduler"
    """The Scheduler's seal job (hourly)."""
    QUIET_PERIOD = "quiet-period"
    """The sweeper: nothing arrived for ``quiet_period_s``."""
    MAX_AGE = "max-age"
    """The sweeper: the oldest pending arrival passed ``max_batch_age_s``."""
    MANUAL = "manual"
    """An operator: ``retrain run``, or the manual-run function."""
    RETRY = "retry"
    """``retrain run --retry RUN``: that run's objects arrived again (:attr:`Run.retry_of` names it)."""
    BIGQUERY = "bigquery"
    """A watched table's new rows were exported and landed."""
    BIGQUERY_EXPORT = "bigquery-export"
    """A BigQuery export job (``EXPORT DATA``) finished writing its files."""
    OTHER = "other"
    """Read only: a trigger this release does not know (a newer release wrote it)."""


class FailureKind(StrEnum):
    """Why a run did not succeed, as a kind a program matches (its ``reason`` says it to a person).

    The workflow's kinds are the tags it raises (``workflows/retrain.yaml``, its ``failure_kind``
    sub-workflow); ``tests/test_contracts.py`` keeps the two lists equal."""

    REFUSED = "Refused"
    """Ended before asking for capacity: over the per-run cost cap or its dataset's monthly budget, or a
    plan the trainer would refuse."""
    TOKENIZE_FAILED = "TokenizeFailed"
    """The Dataflow job failed, or wrote no report."""
    TOKENIZE_TIMEOUT = "TokenizeTimeout"
    """The Dataflow job did not finish within ``tokenize_timeout_s``."""
    CAPACITY_ERROR = "CapacityError"
    """DWS failed the capacity request (or its node pool went away)."""
    CAPACITY_TIMEOUT = "CapacityTimeout"
    """DWS did not provision within ``provision_timeout_s``."""
    TRAINING_FAILED = "TrainingFailed"
    """The JobSet failed (its pods, or past its restarts)."""
    TRAINING_TIMEOUT = "TrainingTimeout"
    """Training did not end within ``training_timeout_s``."""
    CANCELLED = "Cancelled"
    """An operator cancelled it (``retrain cancel``)."""
    STEP_FAILED = "StepFailed"
    """A call the workflow made failed otherwise: a Python step refused it, or an API answered an error."""
    EXECUTION_LOST = "ExecutionLost"
    """Its workflow execution no longer exists, or ended without recording an outcome."""


class BatchState(StrEnum):
    """A batch exists once sealed; until then its arrivals are simply :class:`Pending`."""

    SEALED = "sealed"
    STARTED = "started"
    DUPLICATE = "duplicate"


@dataclass(frozen=True)
class Pending:
    """A dataset's arrivals since its last seal: what the sweeper judges quiet or old enough to seal."""

    dataset: str
    objects: int
    first_arrival_at: str
    last_arrival_at: str


def iso(t: datetime) -> str:
    """The ledger's timestamp format: UTC, fixed width, so timestamps sort as text."""
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def execution_id(name: str) -> str:
    """An execution's id from its resource name (``projects/P/locations/L/workflows/W/executions/ID``):
    the API may name the project by number where the caller used its id, so two names of one execution
    compare by this."""
    return name.rsplit("/", 1)[-1]


def parse_iso(text: str | None) -> datetime | None:
    """An RFC 3339 timestamp of the record (``iso``'s, or the workflow's ``time.format``, whose fraction
    may have nine digits) as an aware datetime; None for None, empty or unreadable text."""
    if not text:
        return None
    head, dot, rest = text.replace("Z", "+00:00").partition(".")
    if dot:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        head = f"{head}.{rest[: min(digits, 6)]}{rest[digits:]}"
    try:
        parsed = datetime.fromisoformat(head)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def now_iso() -> str:
    return iso(datetime.now(UTC))


#: What :func:`new_run_id` makes (a dataset's name, its time, a random suffix): the one check of a run id
#: that comes in from outside (an operator's cancel).
RUN_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def node_cost_usd(node_seconds: float, price_per_node_hour: float) -> float:
    """GPU node time at the price of a node-hour: a run's cost, whether estimated before it starts
    (``retrain.plan.estimate``) or accounted at its end (the ``account`` step), by this one formula."""
    return node_seconds / 3600 * price_per_node_hour


def gpu_hours(node_seconds: float, gpus_per_node: int) -> float:
    """GPU node time in GPU-hours."""
    return node_seconds * gpus_per_node / 3600


def new_run_id(dataset: str) -> str:
    """Sortable by time, unique, and a valid Kubernetes label value / DNS label part."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{dataset[:20]}-{stamp}-{uuid.uuid4().hex[:6]}".lower()


def snapshot_id(content_hashes: Iterable[str]) -> str:
    """Identity of a data snapshot: order-free hash of its objects' content hashes.

    Identical data re-uploaded under new names or generations has the same snapshot id.
    """
    h = hashlib.sha256()
    for digest in sorted(set(content_hashes)):
        h.update(digest.encode())
        h.update(b"\n")
    return h.hexdigest()


class ProfileName(StrEnum):
    """The trainer profiles (``retrain.trainers``): which trainer, in which image, a run's command is
    rendered for (:attr:`Run.profile`)."""

    NEMO_24_12 = "nemo-24.12"
    """NeMo 1.0's Megatron GPT pre-training script in ``nvcr.io/nvidia/nemo:24.12``."""
    MEGATRON_BRIDGE = "megatron-bridge"
    """Megatron-Bridge's ``run_recipe.py`` in a current NeMo Framework image."""


#: The trainer profile a dataset trains with unless configured otherwise, and the one of every record
#: written before profiles were recorded (NeMo 24.12's, the only one then): ``retrain.trainers.nemo``.
DEFAULT_PROFILE = ProfileName.NEMO_24_12
#: Batches of held-out data each validation reads, the eval gate's evidence: NeMo 24.12's own
#: ``trainer.limit_val_batches`` (megatron_gpt_config.yaml), also given to Megatron-Bridge (its
#: ``validation.eval_iters``, 32 by default) so that both profiles' checkpoints are judged on as much.
VALIDATION_BATCHES = 50


@dataclass(frozen=True)
class Champion:
    """The checkpoint a dataset's next run continues from: the last one promoted."""

    run_id: str
    """The run that trained it."""
    checkpoint: str
    """``gs://`` folder of the checkpoint."""
    step: int
    """Its optimizer step (the next run trains on from there)."""
    val_loss: float | None = None
    """Its validation loss, when its run validated."""
    eval_set: str | None = None
    """The dataset's eval set that loss was measured on (None: its run's own validation split)."""
    profile: str = DEFAULT_PROFILE
    """The trainer profile that wrote it: its checkpoint format is that trainer's (a champion recorded
    before profiles were recorded was NeMo 24.12's, the only one then)."""
    consumed_samples: int | None = None
    """Sequences its lineage trained on up to it (None: not recorded), so that a trainer whose count
    restarts at a pretrained checkpoint (Megatron-Bridge) still reports the lineage's."""
    fingerprint: str | None = None
    """sha256 over its files' names, generations and MD5s when it was promoted (None: promoted before
    this was recorded): a run restores it only while its files are still exactly those (a checkpoint
    unpickles, so one rewritten in place by anyone who can write there must never be loaded)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Champion:
        return cls(
            str(d["run_id"]),
            str(d["checkpoint"]),
            int(d["step"]),
            d.get("val_loss"),
            d.get("eval_set"),
            str(d.get("profile") or DEFAULT_PROFILE),
            d.get("consumed_samples"),
            d.get("fingerprint"),
        )


@dataclass(frozen=True)
class Evaluation:
    """The eval gate's verdict on a run's checkpoint (the run record's ``eval``)."""

    val_loss: float | None
    """The run's last validation loss (None: no validation ran)."""
    champion_val_loss: float | None
    """The dataset's champion's, when the run started from one (None: the dataset's first run)."""
    champion_run: str | None
    """The run that trained that champion."""
    compared_on: str | None
    """What the champion's loss was measured on: ``this run's validation data`` (the trainer validated
    the champion on it before training), ``the dataset's eval set`` (this run's and the champion's
    fixed eval set), or ``the champion's own validation data`` (its run's val_loss); None without a
    comparison."""
    promoted: bool
    """Whether the checkpoint became the champion (the next run continues from it)."""
    reason: str
    """Why, in a sentence."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Evaluation:
        """A record's ``eval`` as :meth:`to_dict` wrote it."""
        return cls(
            val_loss=d.get("val_loss"),
            champion_val_loss=d.get("champion_val_loss"),
            champion_run=d.get("champion_run"),
            compared_on=d.get("compared_on"),
            promoted=bool(d.get("promoted")),
            reason=str(d.get("reason") or ""),
        )


SAME_DATA = "this run's validation data"
EVAL_SET = "the dataset's eval set"
CHAMPIONS_DATA = "the champion's own validation data"


def finite(loss: float | None) -> float | None:
    """``loss`` when it is a finite number, else None: a NaN compares false with everything and an
    infinity with nothing useful, so neither may decide (or, as a champion's, disable) the gate."""
    return loss if isinstance(loss, int | float) and math.isfinite(loss) else None


def evaluate(
    val_loss: float | None,
    champion: Champion | None,
    margin: float,
    base_val_loss: float | None = None,
    eval_set: str | None = None,
) -> Evaluation:
    """Promote a checkpoint only when its validation loss is not worse than the champion's by more than
    ``margin`` (relative: 0.02 lets it be 2% worse); a dataset's first checkpoint is promoted as is.

    The champion's loss is taken on the data ``val_loss`` was measured on when it is known there: the
    champion's own loss when it was measured on the same ``eval_set`` (the ledger's number, which no
    trainer output can change), else ``base_val_loss`` (the trainer validated the champion before
    training, on this run's validation split); else the one its own run recorded, on its own data.
    A loss that is not a finite number never promotes: not the run's, and not as a champion's."""
    if val_loss is not None and finite(val_loss) is None:
        return Evaluation(
            None,
            finite(champion.val_loss) if champion else None,
            champion.run_id if champion else None,
            None,
            False,
            f"val_loss {val_loss} is not a finite number: refused",
        )
    if champion is None:
        if val_loss is None:
            return Evaluation(
                None, None, None, None, True, "the dataset's first checkpoint (no validation ran)"
            )
        return Evaluation(val_loss, None, None, None, True, "the dataset's first checkpoint")
    theirs: float | None
    recorded = finite(champion.val_loss)
    if eval_set and champion.eval_set == eval_set and recorded is not None:
        theirs, on = recorded, EVAL_SET
    elif finite(base_val_loss) is not None:
        theirs, on = finite(base_val_loss), EVAL_SET if eval_set else SAME_DATA
    else:
        theirs, on = recorded, CHAMPIONS_DATA
    if theirs is None:
        return Evaluation(val_loss, None, champion.run_id, None, True, NOTHING_TO_COMPARE)
    base = Evaluation(val_loss, theirs, champion.run_id, on, False, "")
    if val_loss is None:
        return replace(base, reason="no validation loss to compare with the champion's")
    bound = theirs * (1 + margin)
    if val_loss > bound:
        return replace(
            base,
            reason=f"val_loss {val_loss:.4f} is worse than the champion's {theirs:.4f} on {on} "
            f"by more than the margin of {margin:g} (bound {bound:.4f})",
        )
    return replace(
        base,
        promoted=True,
        reason=f"val_loss {val_loss:.4f} is within the margin of the champion's {theirs:.4f} on {on}",
    )


NOTHING_TO_COMPARE = "the champion has no validation loss: promoted without a comparison"


@dataclass(frozen=True)
class TrainingMetrics:
    """What the trainer reported, read from its TensorBoard events and checkpoint names."""

    steps: int
    """The last optimizer step reached (counting the base checkpoint's)."""
    run_steps: int
    """Steps this run trained."""
    final_loss: float | None
    """The last training loss logged."""
    val_loss: float | None
    """The last validation loss (None: no validation ran)."""
    consumed_samples: int | None
    """Sequences consumed, counting the base checkpoint's."""
    tokens_seen: int | None
    """Tokens trained on, the base checkpoint's included (consumed samples x the sequence length)."""
    base_val_loss: float | None = None
    """The base checkpoint's validation loss on this run's validation data, measured before training
    (None: the trainer did not measure it, as NeMo's script does not)."""
    outside_plan: int = 0
    """Scalars left out because their step lies outside the run's plan (below 0 or past its last step):
    they are not this run's, and would otherwise set the champion's step and the next cost estimate."""

    def to_dict(self) -> dict[str, Any]:
        """The record's ``metrics``: a loss that is not a finite number is None here (JSON has no NaN,
        and the workflow parses the answer as JSON); the eval gate saw it and said so in ``eval``."""
        return {k: finite(v) if isinstance(v, float) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainingMetrics:
        """A record's ``metrics`` as :meth:`to_dict` wrote it (a field it lacks reads as not reported)."""
        return cls(
            steps=int(d.get("steps") or 0),
            run_steps=int(d.get("run_steps") or 0),
            final_loss=d.get("final_loss"),
            val_loss=d.get("val_loss"),
            consumed_samples=d.get("consumed_samples"),
            tokens_seen=d.get("tokens_seen"),
            base_val_loss=d.get("base_val_loss"),
            outside_plan=int(d.get("outside_plan") or 0),
        )


@dataclass(frozen=True)
class ObjectSetAside:
    """An object its run's tokenize job set aside whole, unread (the report's ``quarantined_objects``)."""

    object: str
    """Its URI, as the run named it."""
    generation: int | None
    """The generation the run was to read (None: whatever was there)."""
    reason: str
    """Why, for a program: ``retrain.contracts.SetAside``'s values (``unreadable``, ``object_changed``...)."""
    detail: str = ""
    """What was found, for a person."""

    @property
    def version(self) -> tuple[str, int]:
        """``(object, generation)``, as the ledger keys an object version (0: no generation)."""
        return self.object, self.generation or 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ObjectSetAside:
        """An entry as the tokenize job writes it (its report, the record's copy)."""
        try:
            generation = int(d.get("generation") or 0) or None
        except (TypeError, ValueError):  # one malformed entry never stops every reader of the ledger
            generation = None
        return cls(
            object=str(d.get("object") or ""),
            generation=generation,
            reason=str(d.get("reason") or ""),
            detail=str(d.get("detail") or ""),
        )


@dataclass
class Run:
    """The record every run leaves behind (``runs/<run_id>`` in the ledger)."""

    run_id: str
    """Sortable, unique id (also the ``retrain.dev/run-id`` label)."""
    dataset: str
    """The dataset it trains."""
    trigger: Trigger
    """What sealed its first batch."""
    status: RunStatus = RunStatus.PENDING
    """Where it is (terminal: succeeded, failed, cancelled)."""
    batch_id: str = ""
    """The first sealed batch whose content it holds."""
    retry_of: str | None = None
    """The run whose objects it re-runs, when a retry's seal made it (:attr:`Trigger.RETRY`)."""
    snapshot: str = ""
    """Hash of its objects' content hashes, fixed when it starts."""
    objects: int = 0
    """Distinct objects it trains on."""
    documents: int = 0
    """Documents the tokenize job wrote."""
    tokens: int = 0
    """Tokens the tokenize job wrote."""
    quarantined: int = 0
    """Records the tokenize job set aside."""
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    """Those records by reason (``invalid_json``, ``missing_key``, ...); each record is in the
    quarantine file beside its shard, with its object and line."""
    quarantined_objects: list[ObjectSetAside] = field(default_factory=list)
    """Objects set aside whole (the first 100; all of them are in the run's
    ``tokenize_report_shards.json``)."""
    quarantined_object_count: int = 0
    """How many objects were set aside whole."""
    nodes: int = 0
    """GPU nodes it asked DWS for."""
    gpu_node_seconds: float = 0.0
    """Node time from capacity provisioned to zero nodes (what the pool bills)."""
    idle_node_seconds: float = 0.0
    """The part of it after training ended: releasing, and the autoscaler's scale-down delay."""
    gpu_hours: float = 0.0
    """``gpu_node_seconds`` x GPUs per node, in hours."""
    cost_usd: float = 0.0
    """Estimated cost of its node time."""
    estimated_cost_usd: float | None = None
    """Its cost as priced when it started (``retrain.plan.estimate``), against the per-run cap."""
    cost_cap_usd: float | None = None
    """The per-run cost cap it started under (None: none)."""
    budget_month: str | None = None
    """The calendar month (UTC, ``YYYY-MM``) its start was priced in: where it counts against its
    dataset's monthly budget (None: it never started)."""
    nodes_at_end: int | None = None
    """GPU nodes still up when it ended (0 when every GPU went back)."""
    release_observed_at: str | None = None
    """When the reaper saw the node pool at zero for a run whose own end did not record ``nodes_at_end``
    (its execution was lost, or it ended before anything recorded it); None when its end recorded it."""
    profile: str | None = None
    """The trainer profile that rendered its command (``nemo-24.12`` or ``megatron-bridge``)."""
    image: str | None = None
    """The training container's image."""
    command: list[str] | None = None
    """The trainer's argv as submitted (container command and arguments)."""
    blend: list[Any] | None = None
    """The exact blend trained on: ``[weight, gs://prefix, ...]``."""
    eval_set: str | None = None
    """The ``gs://`` Megatron prefix the run validated on: the dataset's (configured, or the one its
    champion was validated on), or the one its tokenize job carved from its objects (never trained on);
    null: its blend's validation split."""
    base_checkpoint: str | None = None
    """The checkpoint it continued from (null: the dataset's first run)."""
    base_step: int = 0
    """That checkpoint's step."""
    checkpoint: str | None = None
    """The checkpoint it produced."""
    metrics: TrainingMetrics | None = None
    """What the trainer reported (None: none were found)."""
    eval: Evaluation | None = None
    """The eval gate's verdict: its validation loss against the champion's, and whether it was promoted
    (None: no checkpoint was judged)."""
    reason: str | None = None
    """Why it ended as it did (failures, cancels, missing metrics), for a person."""
    cancel_requested_by: str | None = None
    """Who asked to cancel it (``retrain cancel``: the operator's Google account), as the ledger recorded
    the request before signalling the run's callback; the workflow stops only on a cancel recorded here."""
    cancel_reason: str | None = None
    """The operator's words with that request."""
    failure: FailureKind | None = None
    """The kind of failure of a run that did not succeed (None for one that did, or still runs)."""
    content_returned: bool = False
    """It did not succeed and gave its content back: identical bytes are new again, and
    ``retrain run --retry`` re-runs its objects (kept under ``runs/{run}/objects``)."""
    returned_untrained: int = 0
    """Objects of a run that trained the rest, set aside whole by its tokenize job (gone, unreadable, too
    large), whose content it gave back: it never trained, so identical bytes are new again (and a copy
    of a gone object's bytes under another name arrives again by itself)."""
    service_account: str | None = None
    """The Kubernetes service account its pods run as (its plan's ``run_account``, which its workflow
    creates and deletes): the one identity its folder's write grant names.  None: planned before runs had
    accounts of their own (its handover refuses it)."""
    manifest_generation: int | None = None
    """The generation of its manifest (``runs/RUN/objects.json``) as its start wrote it: the version its
    tokenize job reads."""
    execution: str | None = None
    """Its workflow execution."""
    callback_url: str | None = None
    """Its execution's callback endpoint (completions and cancels arrive there)."""
    created_at: str = field(default_factory=now_iso)
    """When it was made: sealed data became a pending run (it queues until it starts)."""
    tokenizing_at: str | None = None
    """When its workflow started tokenizing."""
    provisioning_at: str | None = None
    """When it asked DWS for capacity."""
    training_at: str | None = None
    """When the capacity came and its JobSet was submitted."""
    work_ended_at: str | None = None
    """When training ended (or, for a run that never trained, when its release began)."""
    updated_at: str = field(default_factory=now_iso)
    finished_at: str | None = None
    """When it ended: every node released (or given up on after the release timeout)."""

    @property
    def triggered_by(self) -> str:
        """Its trigger for a person: a retry names the run it re-runs (``retry of RUN``)."""
        return f"{self.trigger} of {self.retry_of}" if self.retry_of else str(self.trigger)

    @property
    def waited_for_capacity_s(self) -> float | None:
        """How long it waited for capacity: from asking DWS until its JobSet was submitted (or, when
        the capacity never came, until it gave up); None when it never asked."""
        asked = parse_iso(self.provisioning_at)
        came = parse_iso(self.training_at) or parse_iso(self.work_ended_at)
        return (came - asked).total_seconds() if asked and came else None

    @property
    def promoted(self) -> bool:
        """Its checkpoint became its dataset's champion: its content is in the model, whatever happened
        after (a release that failed), so it is never given back."""
        return self.eval is not None and self.eval.promoted

    @property
    def refused(self) -> bool:
        """It succeeded, and the eval gate refused its checkpoint: its content trained, but not into the
        lineage the dataset's next run continues.  The content stays with it (training the same data from
        the same champion again would most likely be refused again, GPU time spent in a loop); ``retrain
        run --retry`` gives it back so that it trains on the champion, when an operator decides so."""
        return self.status == RunStatus.SUCCEEDED and self.eval is not None and not self.eval.promoted

    @property
    def unpriced(self) -> bool:
        """Node time recorded without its price: the workflow's ``account`` step could not run (its cost
        reads 0; the monthly budget counts its estimate instead)."""
        return self.gpu_node_seconds > 0 and self.gpu_hours == 0 and self.cost_usd == 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = str(self.status)
        d["failure"] = None if self.failure is None else str(self.failure)
        d["metrics"] = None if self.metrics is None else self.metrics.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Run:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["status"] = RunStatus(known.get("status", "pending"))
        known["trigger"], retry_of = read_trigger(known.get("trigger"))
        known["retry_of"] = known.get("retry_of") or retry_of
        known["failure"] = _failure_kind(known.get("failure"))
        for name, kind in (("metrics", TrainingMetrics), ("eval", Evaluation)):
            value = known.get(name)
            known[name] = kind.from_dict(value) if isinstance(value, Mapping) and value else None
        aside = known.get("quarantined_objects") or []
        known["quarantined_objects"] = [ObjectSetAside.from_dict(q) for q in aside if isinstance(q, Mapping)]
        return cls(**known)


_RETRY_OF = "retry of "
"""How releases before :attr:`Run.retry_of` recorded a retry's trigger: ``retry of RUN``."""


def read_trigger(value: Any) -> tuple[Trigger, str | None]:
    """A stored trigger (a run's, a sealed batch's), and the run it retries if it names one: ``retry of
    RUN`` (as earlier releases wrote a retry's) reads as a retry of RUN; a trigger this release does not
    know (a newer release's) as :attr:`Trigger.OTHER`, so that one record never stops every reader."""
    text = str(value or "")
    if text.startswith(_RETRY_OF):
        return Trigger.RETRY, text.removeprefix(_RETRY_OF) or None
    try:
        return Trigger(text), None
    except ValueError:
        return Trigger.OTHER, None


def _failure_kind(value: Any) -> FailureKind | None:
    """A record's ``failure``; a kind this release does not know (written by a newer workflow) reads as a
    failed step, so that one record never stops every reader of the ledger."""
    if not value:
        return None
    try:
        return FailureKind(value)
    except ValueError:
        return FailureKind.STEP_FAILED
