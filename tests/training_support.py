"""Test helpers shared by the trainer and cluster tests: tiny Megatron datasets and tokenizers, the NeMo
profile's arguments for them, and the real CLIs as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrain_tokenize.megatron import IndexedDatasetWriter

REPO = Path(__file__).resolve().parents[1]


def write_dataset(
    prefix: Path, documents: Sequence[Sequence[int]], dtype: type[np.generic] = np.uint16
) -> Path:
    """PREFIX.bin/.idx holding one sequence per document."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(str(prefix) + ".bin", "wb") as f:
        w = IndexedDatasetWriter(f, dtype)
        for doc in documents:
            w.add_document([doc])
    Path(str(prefix) + ".idx").write_bytes(w.index_bytes())
    return prefix


def pattern_documents(n_docs: int = 20, length: int = 200, period: int = 16) -> list[list[int]]:
    """Counting 0..period-1 over and over: a pattern a tiny model learns in a few dozen steps."""
    return [[(i + d) % period for i in range(length)] for d in range(n_docs)]


def random_documents(n_docs: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(20, 300))).tolist() for _ in range(n_docs)]


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RETRAIN_", "WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_"))
    }
    env.pop("LOCAL_WORLD_SIZE", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def standin_env(**extra: str) -> dict[str, str]:
    """A test's child environment with the stand-in image's own (``retrain_local.images.STANDIN_ENV``): a
    rank started here runs as a pod of that image does."""
    from retrain_local.images import STANDIN_ENV

    return child_env(**{**STANDIN_ENV, **extra})


def run_module(
    module: str, *args: object, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tiny_tokenizer(folder: Path, vocab: int = 16) -> tuple[Path, Path]:
    """A vocabulary of ``vocab`` ids in GPT-2's file format (encoder.json, vocab.bpe): what the stand-in
    sizes its embedding from, kept small so that a test trains in seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({f"t{i}": i for i in range(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return folder / "vocab.json", folder / "merges.txt"


def profile_command(
    name: str,
    root: Path,
    blend: Sequence[object],
    *,
    nodes: int = 1,
    gpus: int = 1,
    steps: int = 20,
    global_batch: int = 8,
    seq: int = 32,
    base: str | None = None,
    base_step: int = 0,
    run_id: str = "r1",
    eval_set: str | None = None,
) -> Any:
    """Profile ``name``'s command for a run whose gs://b/... paths are the folders under ``root`` (as the
    pod's Cloud Storage FUSE mount would show them), checked like a run's."""
    from retrain.trainers import BatchShape, TokenizerFiles, TrainingPlan, profile

    plan = TrainingPlan(
        run_id,
        BatchShape(nodes, gpus, 1, global_batch),
        steps=steps,
        seq_length=seq,
        output_dir=f"gs://b/runs/{run_id}",
        base_checkpoint=base,
        base_step=base_step,
        blend=tuple(blend),
        tokenizer=TokenizerFiles("GPT2BPETokenizer", "gs://b/tok/vocab.json", "gs://b/tok/merges.txt"),
        eval_set=eval_set,
        profile=name,
    )
    trainer = profile(name)
    command = trainer.render(plan, lambda uri, write=False: uri.replace("gs://", f"{root}/"))
    trainer.validate(command)
    return command


def nemo_args(root: Path, blend: Sequence[object], **plan: Any) -> list[str]:
    """The NeMo 24.12 profile's arguments (:func:`profile_command`)."""
    return list(profile_command("nemo-24.12", root, blend, **plan).args)


def bridge_args(root: Path, blend: Sequence[object], **plan: Any) -> list[str]:
    """The megatron-bridge profile's run_recipe.py arguments: what follows the script's path."""
    from retrain.trainers.megatron_bridge import RUN_RECIPE

    args = list(profile_command("megatron-bridge", root, blend, **plan).args)
    return args[args.index(RUN_RECIPE) + 1 :]


def torchrun(
    script: Path, args: list[str], nproc: int = 1, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nnodes 1 --nproc-per-node N SCRIPT ARGS``, as the JobSet's launcher runs it."""
    from retrain_local.processes import free_port

    launcher = Path(sys.executable).with_name("torchrun")
    argv = [str(launcher), "--nnodes=1", f"--nproc-per-node={nproc}", "--node-rank=0"]
    argv += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), *args]
    return subprocess.run(
        argv, cwd=REPO, env=standin_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout
    )


def pattern_bucket(root: Path) -> Path:
    """The bucket "b" as a pod sees it under ``root``: a counting pattern (60 documents) at
    ``gs://b/shards/p/data_text_document`` and a 16-id tokenizer at ``gs://b/tok``."""
    write_dataset(root / "b" / "shards" / "p" / "data_text_document", pattern_documents(60, 120))
    tiny_tokenizer(root / "b" / "tok")
    return root
