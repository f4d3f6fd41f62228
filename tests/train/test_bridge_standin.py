"""The local image's stand-in for Megatron-Bridge's run_recipe.py, run as the JobSet runs it: the
megatron-bridge profile's arguments under PyTorch's real torchrun."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from training_support import REPO, bridge_args, pattern_bucket, random_documents
from training_support import torchrun as run_torchrun
from training_support import write_dataset as write_megatron

from retrain.tensorboard import read_scalars

STANDIN = REPO / "retrain_local" / "train" / "bridge_standin.py"
torch = pytest.importorskip("torch", reason="PyTorch is not installed: the stand-in trains with it")
BLEND = [1.0, "gs://b/shards/p/data_text_document"]

pytestmark = pytest.mark.integration


def torchrun(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess[str]:
    return run_torchrun(STANDIN, args, nproc)


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bucket "b" as a pod sees it: a counting pattern (60 documents) and a 16-id tokenizer."""
    return pattern_bucket(tmp_path_factory.mktemp("gcs"))


def scalars(mount: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for f in (mount / "b" / "runs" / run_id / "tb_logs").glob("events.out.tfevents.*"):
        for s in read_scalars(f.read_bytes()):
            out.setdefault(s.tag, []).append((s.step, s.value))
    return out


def checkpoints(mount: Path, run_id: str) -> list[str]:
    return sorted(p.name for p in (mount / "b" / "runs" / run_id / "checkpoints").iterdir())


def test_two_ranks_train_the_profiles_command_and_write_bridges_layout(mount: Path) -> None:
    r = torchrun(bridge_args(mount, BLEND, gpus=2, steps=20, run_id="two"), nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on 2 rank(s): steps 0->20, global batch 8 = micro 1 x DP 2 x 4 accumulation" in r.stdout
    # checkpoint.save: iter_{:07d} folders and Bridge's two trackers (checkpointing.md; checkpoint_utils.py)
    assert checkpoints(mount, "two") == [
        "iter_0000020",
        "latest_checkpointed_iteration.txt",
        "latest_train_state.pt",
    ]
    assert (
        mount / "b" / "runs" / "two" / "checkpoints" / "latest_checkpointed_iteration.txt"
    ).read_text() == "20"
    tb = scalars(mount, "two")
    losses = [v for _, v in sorted(tb["lm loss"])]
    assert losses[-1] < losses[0] - 0.5  # the counting pattern is learnt
    assert [s for s, _ in tb["lm loss validation"]] == [20]
    assert max(s for s, _ in tb["lm loss vs samples"]) == 160  # 20 steps x global batch 8
    assert list((mount / "b" / "runs" / "two" / "index_cache").glob("*_train_doc_idx.npy"))


def test_continual_training_loads_the_base_weights_and_counts_from_zero(mount: Path) -> None:
    first = torchrun(bridge_args(mount, BLEND, steps=10, run_id="base"))
    assert first.returncode == 0, first.stdout + first.stderr
    base = "gs://b/runs/base/checkpoints/iter_0000010"
    second = torchrun(bridge_args(mount, BLEND, steps=10, run_id="next", base=base, base_step=10))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"loaded the weights of {mount}/b/runs/base/checkpoints/iter_0000010" in second.stdout
    assert "steps 0->10" in second.stdout and checkpoints(mount, "next")[0] == "iter_0000010"
    tb = scalars(mount, "next")
    # the base validated on this run's data at iteration 0 (the eval gate's comparison), then trained on:
    # it starts where the base ended, far below a fresh model's first loss
    (at_base,) = [v for s, v in tb["lm loss validation"] if s == 0]
    assert f"iteration 0 lm loss validation {at_base:.4f}" in second.stdout
    fresh = min(v for s, v in scalars(mount, "base")["lm loss"] if s == 1)
    assert min(v for s, v in tb["lm loss"] if s == 1) < fresh - 0.5


def test_a_restarted_pod_resumes_its_own_run_not_the_base(mount: Path) -> None:
    args = bridge_args(mount, BLEND, steps=4, run_id="again", base="gs://b/runs/nowhere", base_step=4)
    r = torchrun(args)
    assert r.returncode != 0 and f"Pretrained checkpoint {mount}/b/runs/nowhere does not exist" in r.stderr
    assert torchrun(bridge_args(mount, BLEND, steps=4, run_id="origin")).returncode == 0
    base = "gs://b/runs/origin/checkpoints/iter_0000004"
    args = bridge_args(mount, BLEND, steps=4, run_id="again", base=base, base_step=4)
    first = torchrun(args)
    assert first.returncode == 0 and "loaded the weights of" in first.stdout, first.stderr
    # the pod again, its run's own checkpoint.load at iteration 4: that wins over the base's weights
    resumed = torchrun(args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed {mount}/b/runs/again/checkpoints at iteration 4" in resumed.stdout
    assert "loaded the weights of" not in resumed.stdout and "steps 4->4" in resumed.stdout
    # Bridge checks the pretrained checkpoint exists even when it resumes (CheckpointConfig.finalize)
    gone = bridge_args(
        mount, BLEND, steps=4, run_id="again", base="gs://b/runs/origin/checkpoints/iter_9", base_step=4
    )
    r = torchrun(gone)
    assert r.returncode != 0 and "Pretrained checkpoint" in r.stderr and "does not exist" in r.stderr


def test_a_datasets_eval_set_validates_instead_of_the_split(mount: Path) -> None:
    """blend_per_split: train on the blend whole, validate on the eval set (noise no model can learn)."""
    write_megatron(mount / "b" / "eval" / "noise_text_document", random_documents(20, 16))
    args = bridge_args(mount, BLEND, steps=20, run_id="evalset", eval_set="gs://b/eval/noise_text_document")
    prefix, noise = f"{mount}/b/shards/p/data_text_document", f"{mount}/b/eval/noise_text_document"
    assert f"dataset.blend_per_split=[[[{prefix}],[1.0]],[[{noise}],null],null]" in args
    assert "dataset.split=null" in args
    r = torchrun(args)
    assert r.returncode == 0, r.stdout + r.stderr
    ((_, on_noise),) = scalars(mount, "evalset")["lm loss validation"]
    assert on_noise > math.log(16) - 0.1  # uniform noise over 16 ids: no better than its entropy


def test_what_bridge_would_refuse_is_refused(mount: Path) -> None:
    args = bridge_args(mount, BLEND, run_id="bad")
    r = torchrun([*args, "train.train_iterz=3"])
    assert r.returncode != 0 and "Could not override 'train.train_iterz'" in r.stderr
    r = torchrun([*args, "--max_steps", "3"])
    assert r.returncode != 0 and "run_recipe.py: Unknown option: --max_steps" in r.stderr
    r = torchrun(args, nproc=3)  # global batch 8 over 3 data-parallel ranks
    assert (
        r.returncode != 0
        and "global batch size 8 is not divisible by micro batch size 1 x data-parallel" in (r.stderr)
    )
