"""Trainer profiles: one profile-neutral training plan, rendered by each profile into its container's
command.

A run's :class:`TrainingPlan` says what to train (the blend, the tokenizer's files), how (nodes, GPUs,
batch sizes, parallelism, steps), from what (the base checkpoint) and where the results go.  A profile
(:mod:`retrain.trainers.nemo` for NeMo 24.12's Megatron GPT script) turns it into the exact command and
arguments its image runs, checks every argument against the trainer's own configuration schema, and
knows where that trainer writes its checkpoints and TensorBoard events.  The plan is checked twice:
when the run starts (with a stand-in blend, so a run that cannot start never asks for capacity) and
when the tokenized data is handed over.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any, Protocol

from retrain.domain.errors import PlanError
from retrain.domain.runs import DEFAULT_PROFILE, VALIDATION_BATCHES
from retrain.tensorboard import Scalar


@dataclass(frozen=True)
class BatchShape:
    """How a run's GPUs share the work (Megatron's batch arithmetic)."""

    nodes: int
    """GPU nodes (``trainer.num_nodes``)."""
    gpus_per_node: int
    """GPUs per node, one process each (``trainer.devices``)."""
    micro_batch_size: int
    """Sequences per GPU per forward pass."""
    global_batch_size: int
    """Sequences per optimizer step, over every data-parallel rank and micro-batch."""
    tensor_parallel: int = 1
    """Tensor (intra-layer) model parallel size."""
    pipeline_parallel: int = 1
    """Pipeline (inter-layer) model parallel size."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        """Data-parallel size: world / (tensor x pipeline parallel)."""
        return self.world // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def accumulation(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel)

    def problems(self) -> list[str]:
        """Why Megatron would refuse this shape at start-up (empty when it starts).

        Megatron asserts that the world size is divisible by tensor x pipeline parallel and that the
        global batch is divisible by micro batch x data-parallel size (``../shared/specs/nemo-24.12``)."""
        out = []
        for name in ("nodes", "gpus_per_node", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, not {getattr(self, name)}")
        if out:
            return out
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world % model_parallel:
            return [
                f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s) = {self.world} GPUs is not divisible by "
                f"tensor parallel {self.tensor_parallel} x pipeline parallel {self.pipeline_parallel}"
            ]
        per_step = self.micro_batch_size * self.data_parallel
        if self.global_batch_size % per_step:
            out.append(
                f"global batch size {self.global_batch_size} is not divisible by micro batch size "
                f"{self.micro_batch_size} x data-parallel size {self.data_parallel} = {per_step} "
                f"({self.world} GPUs / (TP {self.tensor_parallel} x PP {self.pipeline_parallel}))"
            )
        return out


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer the run's data was tokenized with, as files the trainer can read."""

    type: str
    """``GPT2BPETokenizer`` (vocab + merges) or ``HuggingFaceTokenizer`` (a ``tokenizer.json``)."""
    vocab_file: str | None = None
    """``gs://`` URI of GPT-2's ``encoder.json``-style vocabulary."""
    merge_file: str | None = None
    """``gs://`` URI of the BPE merges (``vocab.bpe``)."""
    tokenizer_json: str | None = None
    """``gs://`` URI of an HF ``tokenizer.json``."""

    @classmethod
    def parse(cls, value: Mapping[str, Any]) -> TokenizerFiles:
        known = {k: value[k] for k in ("type", "vocab_file", "merge_file", "tokenizer_json") if k in value}
        if not isinstance(known.get("type"), str):
            raise PlanError(f"the tokenizer {dict(value)!r} names no type")
        if any(v is not None and not isinstance(v, str) for v in known.values()):
            raise PlanError(f"the tokenizer {dict(value)!r}: its files must be gs:// URIs")
        return cls(**known)


@dataclass(frozen=True)
class TrainingPlan:
    """What one run trains, in profile-neutral terms (``gs://`` URIs, not the pod's mount paths).

    Decided when the run starts (:func:`retrain.plan.training_plan`) and completed with the data when
    tokenizing is done (:meth:`with_data`)."""

    run_id: str
    """The run."""
    shape: BatchShape
    """Nodes, GPUs and batch sizes."""
    steps: int
    """Optimizer steps this run trains (beyond its base checkpoint's)."""
    seq_length: int
    """Tokens per training sequence."""
    output_dir: str
    """``gs://`` folder the trainer writes this run's checkpoints and logs under."""
    base_checkpoint: str | None = None
    """``gs://`` checkpoint the run continues from (null: the first run of its dataset)."""
    base_step: int = 0
    """The base checkpoint's step (0 without one): the run trains to ``base_step + steps``."""
    blend: tuple[float | str, ...] = ()
    """Megatron's blend: ``(weight, gs://prefix, weight, gs://prefix, ...)`` (empty until handover)."""
    tokenizer: TokenizerFiles | None = None
    """The tokenizer's files (None until handover)."""
    seed: int = 1234
    """Random seed of the trainer."""
    eval_set: str | None = None
    """``gs://`` Megatron prefix that validates the run instead of its blend's validation split (the
    dataset's fixed evaluation set; null: the split)."""
    profile: str = DEFAULT_PROFILE
    """The trainer profile that renders the run's command and reads its results (chosen for the
    dataset when the run starts; a plan written before profiles were chosen per dataset was NeMo's)."""
    validation_batches: int = VALIDATION_BATCHES
    """Batches of held-out data each validation reads (a plan written before it was set read NeMo's
    default)."""
    base_consumed_samples: int = 0
    """Sequences the lineage had trained on up to the base checkpoint (0: none, or not recorded)."""

    @property
    def final_step(self) -> int:
        return self.base_step + self.steps

    def problems(self) -> list[str]:
        out = self.shape.problems()
        if self.steps < 1:
            out.append(f"steps must be at least 1, not {self.steps}")
        if self.seq_length < 1:
            out.append(f"seq_length must be at least 1, not {self.seq_length}")
        if self.validation_batches < 1:
            out.append(f"validation_batches must be at least 1, not {self.validation_batches}")
        if self.base_step < 0:
            out.append(f"base_step must be >= 0, not {self.base_step}")
        if not self.output_dir.startswith("gs://"):
            out.append(f"output_dir {self.output_dir!r} is not a gs:// URI")
        return out

    def gpt2_files(self, trainer: str) -> TokenizerFiles:
        """The tokenizer of a plan ready to render for ``trainer``, which reads GPT-2 BPE's vocab and
        merges files; PlanError when the plan is malformed, has no data yet, or another tokenizer."""
        problems = self.problems()
        if problems:
            raise PlanError("; ".join(problems))
        if not self.blend or self.tokenizer is None:
            raise PlanError("the plan has no data yet: render it after tokenizing")
        tok = self.tokenizer
        if tok.type != "GPT2BPETokenizer" or not tok.vocab_file or not tok.merge_file:
            raise PlanError(
                f"the {trainer} profile trains GPT2BPETokenizer data (vocab and merges files); this run's "
                f"data was tokenized with {tok.type}"
            )
        return tok

    def with_data(self, blend: list[Any], tokenizer: TokenizerFiles) -> TrainingPlan:
        """The plan with the tokenized data handed over (validated by the profile that renders it)."""
        if not blend:
            raise PlanError("the tokenize report has an empty blend: nothing to train on")
        return replace(self, blend=tuple(blend), tokenizer=tokenizer)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, value: Mapping[str, Any]) -> TrainingPlan:
        """A plan from its JSON form (the workflow hands it back at handover); PlanError when malformed."""
        try:
            body = dict(value)
            body["shape"] = BatchShape(**body["shape"])
            body["blend"] = tuple(body.get("blend") or ())
            tok = body.get("tokenizer")
            body["tokenizer"] = TokenizerFiles.parse(tok) if tok else None
            return cls(**body)
        except (KeyError, TypeError) as e:
            raise PlanError(f"not a training plan: {e}") from None


@dataclass(frozen=True)
class Command:
    """What the training container runs: its ``command`` and ``args`` (Kubernetes' fields)."""

    command: list[str]
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment the command reads (beyond the JobSet's rendezvous variables)."""

    @property
    def argv(self) -> list[str]:
        return [*self.command, *self.args]


#: The pod's path of a ``gs://`` URI (Cloud Storage FUSE), and whether the pod writes there.
MountPath = Callable[..., str]


class Profile(Hashable, Protocol):
    """A trainer: how a plan becomes its container's command, and where its results land; hashable (a frozen
    dataclass), since :func:`check` keeps its verdicts by it."""

    @property
    def name(self) -> str:
        """The profile's name in settings (``RETRAIN_PROFILE``)."""
        ...

    def render(self, plan: TrainingPlan, mount: MountPath) -> Command:
        """The container command for ``plan``; ``mount(uri, write=False)`` gives a URI's pod path."""
        ...

    def validate(self, command: Command) -> None:
        """Raise :class:`PlanError` naming the first argument the trainer would refuse, from the command and
        its arguments alone (:func:`check` keeps the verdict)."""
        ...

    def run_dir(self, plan: TrainingPlan) -> str:
        """``gs://`` folder where the trainer writes this run's ``checkpoints/`` and TensorBoard events."""
        ...

    def final_checkpoint(self, names: Iterable[str]) -> str | None:
        """The run's final checkpoint among the names of the folders in ``<run_dir>/checkpoints/``."""
        ...

    def lineage_scalars(self, scalars: list[Scalar], plan: TrainingPlan) -> list[Scalar]:
        """The trainer's TensorBoard scalars as ``reduced_train_loss``, ``val_loss`` and
        ``consumed_samples`` at the lineage's steps (the base checkpoint's step counting)."""
        ...


def profiles() -> dict[str, Profile]:
    """Every profile, by name."""
    from retrain.trainers.megatron_bridge import MEGATRON_BRIDGE
    from retrain.trainers.nemo import NEMO_24_12

    return {NEMO_24_12.name: NEMO_24_12, MEGATRON_BRIDGE.name: MEGATRON_BRIDGE}


def profile(name: str) -> Profile:
    """The profile called ``name``; PlanError naming the known ones otherwise."""
    known = profiles()
    try:
        return known[name]
    except KeyError:
        raise PlanError(f"unknown trainer profile {name!r} (one of {sorted(map(str, known))})") from None


def check(trainer: Profile, command: Command) -> None:
    """``trainer.validate(command)``, whose verdict is kept for the same arguments: composing a config takes
    Hydra a fifth of a second of CPU, and a process that renders the same plan again (a plan asked for
    twice; the tests' many runs of one plan) need not compose it again."""
    problem = _verdict(trainer, tuple(command.command), tuple(command.args))
    if problem is not None:
        raise PlanError(problem)


@lru_cache(maxsize=64)
def _verdict(trainer: Profile, command: tuple[str, ...], args: tuple[str, ...]) -> str | None:
    """Why ``trainer`` (a frozen, hashable profile) refuses the command, or None.  A profile validates a
    command's arguments only (its configuration files ship with retrain and never change under a
    process), so this is a pure function of them."""
    try:
        trainer.validate(Command(list(command), list(args)))
    except PlanError as e:
        return str(e)
    return None


__all__ = [
    "BatchShape",
    "Command",
    "PlanError",
    "Profile",
    "TokenizerFiles",
    "TrainingPlan",
    "check",
    "profile",
    "profiles",
]
