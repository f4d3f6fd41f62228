"""The local image's stand-in for NeMo's pre-training script, run as the JobSet runs it: the NeMo 24.12
profile's Hydra overrides, under PyTorch's real torchrun (or the stand-in launcher without PyTorch)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from training_support import (
    REPO,
    child_env,
    nemo_args,
    pattern_bucket,
    random_documents,
    tiny_tokenizer,
    write_dataset,
)
from training_support import torchrun as run_torchrun

from retrain.tensorboard import read_scalars

STANDIN = REPO / "retrain_local" / "train" / "standin.py"
torch = pytest.importorskip("torch", reason="PyTorch is not installed: the stand-in trains with it")


def torchrun(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess[str]:
    return run_torchrun(STANDIN, args, nproc)


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bucket "b" as a pod sees it: a counting pattern (60 documents) and a 16-id tokenizer."""
    return pattern_bucket(tmp_path_factory.mktemp("gcs"))


def checkpoints(mount: Path, run_id: str) -> list[str]:
    return sorted(p.name for p in (mount / "b" / "runs" / run_id / "megatron_gpt" / "checkpoints").iterdir())


def scalars(mount: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for f in (mount / "b" / "runs" / run_id / "megatron_gpt").glob("events.out.tfevents.*"):
        for s in read_scalars(f.read_bytes()):
            out.setdefault(s.tag, []).append((s.step, s.value))
    return out


BLEND = [1.0, "gs://b/shards/p/data_text_document"]


@pytest.mark.integration
def test_two_ranks_train_the_profiles_command_and_write_nemos_layout(mount: Path) -> None:
    r = torchrun(nemo_args(mount, BLEND, gpus=2, steps=20, run_id="two"), nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on 2 rank(s): steps 0->20, global batch 8 = micro 1 x DP 2 x 4 accumulation" in r.stdout
    names = checkpoints(mount, "two")
    assert len(names) == 2 and names[1] == names[0] + "-last", names
    assert names[0].startswith("megatron_gpt--val_loss=") and "-step=20-consumed_samples=160.0" in names[0]
    tb = scalars(mount, "two")
    losses = [v for _, v in sorted(tb["reduced_train_loss"])]
    assert losses[-1] < losses[0] - 0.5  # the counting pattern is learnt
    assert [s for s, _ in tb["val_loss"]] == [20] and tb["consumed_samples"][-1] == (20, 160.0)
    assert list((mount / "b" / "runs" / "two" / "index_mapping").glob("*_train_doc_idx.npy"))


@pytest.mark.integration
def test_continual_training_restores_the_base_and_trains_on_to_base_plus_steps(mount: Path) -> None:
    first = torchrun(nemo_args(mount, BLEND, steps=10, run_id="base"))
    assert first.returncode == 0, first.stdout + first.stderr
    (last,) = [n for n in checkpoints(mount, "base") if n.endswith("-last")]
    base = f"gs://b/runs/base/megatron_gpt/checkpoints/{last}"
    second = torchrun(nemo_args(mount, BLEND, steps=10, run_id="next", base=base, base_step=10))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"restored {mount}/b/runs/base/megatron_gpt/checkpoints/{last} at step 10" in second.stdout
    assert "steps 10->20" in second.stdout
    assert any("-step=20-consumed_samples=160.0-last" in n for n in checkpoints(mount, "next"))
    assert min(s for s, _ in scalars(mount, "next")["reduced_train_loss"]) == 11
    # the base checkpoint was validated on this run's data before training: the eval gate's comparison
    (at_base,) = [v for s, v in scalars(mount, "next")["val_loss"] if s == 10]
    assert f"step 10 (base checkpoint) val_loss {at_base:.4f}" in second.stdout


@pytest.mark.integration
def test_a_datasets_eval_set_validates_instead_of_the_split(mount: Path) -> None:
    """NeMo's per-split data_prefix: train on the blend whole, validate on the eval set.  The eval set here
    is noise no model can learn, the training data a pattern it learns: the val_loss tells which was used."""
    write_dataset(mount / "b" / "eval" / "noise_text_document", random_documents(20, 16))
    args = nemo_args(mount, BLEND, steps=20, run_id="evalset", eval_set="gs://b/eval/noise_text_document")
    prefix = f"{mount}/b/shards/p/data_text_document"
    noise = f"{mount}/b/eval/noise_text_document"
    assert (
        f"model.data.data_prefix={{train:[1.0,{prefix}],validation:[1.0,{noise}],test:[1.0,{noise}]}}" in args
    )
    r = torchrun(args)
    assert r.returncode == 0, r.stdout + r.stderr
    split = torchrun(nemo_args(mount, BLEND, steps=20, run_id="split"))  # the same, validated on its split
    assert split.returncode == 0, split.stdout + split.stderr
    ((_, on_noise),) = scalars(mount, "evalset")["val_loss"]
    ((_, on_split),) = scalars(mount, "split")["val_loss"]
    # uniform noise over 16 ids cannot be predicted below its entropy, ln 16 = 2.77; the pattern's own
    # validation documents are predicted better after 20 steps
    assert on_noise > math.log(16) - 0.1 and on_split < on_noise - 0.4, (on_noise, on_split)


@pytest.mark.integration
def test_an_override_nemo_would_refuse_is_refused_with_hydras_message(mount: Path) -> None:
    args = nemo_args(mount, BLEND, run_id="bad")
    r = torchrun([*args, "+model.micro_batch_size=2"])
    assert (
        r.returncode != 0
        and "Could not append to config. An item is already at 'model.micro_batch_size'" in (r.stderr)
    )
    r = torchrun(args, nproc=2)  # devices=1 on the command line, two processes started
    assert (
        r.returncode != 0
        and "torchrun started 2 process(es) but trainer.num_nodes x trainer.devices = 1" in (r.stderr)
    )


@pytest.mark.integration
def test_bad_data_is_named(mount: Path, tmp_path: Path) -> None:
    bad = write_dataset(tmp_path / "b" / "shards" / "bad" / "data_text_document", [[1, 2, 3]] * 5)
    Path(str(bad) + ".bin").write_bytes(b"\x00" * 4)
    tiny_tokenizer(tmp_path / "b" / "tok")
    r = torchrun(nemo_args(tmp_path, [1.0, "gs://b/shards/bad/data_text_document"], run_id="x"))
    assert r.returncode != 0 and f"Error executing job: dataset {bad}: " in r.stderr
    assert 'standin.py", line' not in r.stderr  # a message, not the script's traceback


@pytest.mark.integration
def test_without_pytorch_the_data_is_checked_and_nothing_trained(mount: Path) -> None:
    """No torch: the stand-in launcher starts the script, which checks the blend instead of training."""
    code = (
        "import sys, runpy; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    args = nemo_args(mount, BLEND, run_id="notorch")
    r = subprocess.run(
        [sys.executable, "-c", code, str(STANDIN), *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "PyTorch is not installed: checked the data instead of training" in r.stdout
    assert not (mount / "b" / "runs" / "notorch" / "megatron_gpt").exists()


@pytest.mark.integration
def test_the_stand_in_launcher_starts_ranks_as_torchrun_does(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys; from pathlib import Path\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_PORT')\n"
        "Path(sys.argv[1], os.environ['RANK']).write_text(' '.join(os.environ[k] for k in keys))\n"
    )
    argv = [sys.executable, "-m", "retrain_local.torchrun", "--nnodes=2", "--nproc-per-node=2"]
    argv += ["--node-rank=1", "--master-addr=127.0.0.1", "--master-port=1234", str(script), str(tmp_path)]
    assert subprocess.run(argv, cwd=REPO, env=child_env(), timeout=60).returncode == 0
    assert (tmp_path / "2").read_text() == "2 0 4 2 1 1234" and (
        tmp_path / "3"
    ).read_text() == "3 1 4 2 1 1234"


def test_checkpoint_names_are_formatted_as_lightning_formats_them() -> None:
    from retrain_local.train.standin import checkpoint_name

    template = "megatron_gpt--{val_loss:.2f}-{step}-{consumed_samples}"
    assert (
        checkpoint_name(template, {"val_loss": 4.1234, "step": 60, "consumed_samples": 480.0})
        == "megatron_gpt--val_loss=4.12-step=60-consumed_samples=480.0"
    )
    assert checkpoint_name(template, {"step": 3}) == "megatron_gpt--val_loss=0.00-step=3-consumed_samples=0"


def test_the_split_is_megatrons() -> None:
    """Documents are cut into train / validation / test as megatron-core cuts them (when it is here)."""
    from retrain_local.train.data import split_documents

    config = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")
    for n in (0, 1, 2, 3, 10, 37, 1000):
        for split in ("900,50,50", "99,1,0", "1,1,1", "969, 30, 1"):
            matrix = config.convert_split_vector_to_split_matrix(config.parse_and_normalize_split(split))
            got = split_documents(n, split)
            for (start, end), bounds in zip(got, matrix, strict=True):
                if bounds is None:
                    assert start == end
                else:
                    assert (start, end) == (round(bounds[0] * n), round(bounds[1] * n))
    assert np.array_equal(split_documents(2, "900,50,50"), [(0, 2), (2, 2), (2, 2)])
