"""The small GPT trainer, run as the JobSet runs it: ``python -m retrain.train.gpt`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from retrain.adapters import objects
from retrain.local.emulators import free_port

from .conftest import (
    REPO,
    child_env,
    pattern_documents,
    random_documents,
    read_jsonl,
    run_module,
    write_dataset,
)

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed: the gpt trainer needs it (pip install -e '.[train]')"
)

GPT = "retrain.train.gpt"
SMALL = ["--seq-len", "32", "--d-model", "32", "--layers", "1", "--heads", "2", "--batch-size", "8"]
PATTERN_ARGS = [*SMALL, "--lr", "3e-3", "--seed", "5", "--log-every", "10"]


def run_gpt(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = run_module(GPT, *map(str, args), env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def load(path: Path) -> dict[str, Any]:
    return dict(torch.load(path, map_location="cpu", weights_only=True))


@pytest.fixture(scope="module")
def pattern(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "pattern", pattern_documents())


@pytest.fixture(scope="module")
def straight_run(pattern: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """40 uninterrupted steps on the counting pattern."""
    out = tmp_path_factory.mktemp("straight")
    r = run_gpt("--data-prefix", pattern, "--checkpoint-dir", out, "--max-steps", 40, *PATTERN_ARGS)
    return out, r.stdout


def test_loss_decreases_and_outputs_are_written(straight_run: tuple[Path, str]) -> None:
    out, stdout = straight_run
    assert "step 10/40 loss" in stdout and "step 40/40 loss" in stdout
    log = read_jsonl(out / "loss.jsonl")
    assert [r["step"] for r in log] == [1, 10, 20, 30, 40]
    assert all(set(r) == {"step", "loss", "tokens", "seconds"} for r in log)
    assert [r["tokens"] for r in log] == [s * 8 * 32 for s in (1, 10, 20, 30, 40)]
    m = json.loads((out / "metrics.json").read_text())
    assert m["trainer"] == "gpt" and m["steps"] == 40 and m["tokens_seen"] == 40 * 8 * 32
    assert m["checkpoint"] == str(out / "model.pt") and m["parameters"] > 0 and m["seconds"] > 0
    assert m["config"]["vocab_size"] == 64  # ids 0..15, rounded up to 64
    assert m["initial_loss"] == pytest.approx(log[0]["loss"], abs=1e-5)
    assert m["final_loss"] == pytest.approx(log[-1]["loss"], abs=1e-5)
    assert m["initial_loss"] > 3.5  # about ln(64) at the start
    assert m["final_loss"] < 0.5 * m["initial_loss"]
    ckpt = load(out / "model.pt")
    assert ckpt["step"] == 40 and set(ckpt) >= {"model", "optimizer", "step", "config"}


def test_max_steps_is_the_total_and_resume_matches_an_uninterrupted_run(
    pattern: Path, straight_run: tuple[Path, str], tmp_path: Path
) -> None:
    out = tmp_path / "ckpt"
    run_gpt("--data-prefix", pattern, "--checkpoint-dir", out, "--max-steps", 25, *PATTERN_ARGS)
    assert load(out / "model.pt")["step"] == 25
    # The restarted pod runs the same command with the run's target: only steps 26..40 are trained.
    r = run_gpt("--data-prefix", pattern, "--checkpoint-dir", out, "--max-steps", 40, *PATTERN_ARGS)
    assert "resuming from" in r.stdout and "at step 25" in r.stdout and "steps 25->40" in r.stdout
    assert "step 26/40" in r.stdout and "step 40/40" in r.stdout
    m = json.loads((out / "metrics.json").read_text())
    assert (m["steps"], m["start_step"], m["run_steps"], m["tokens_seen"]) == (40, 25, 15, 40 * 8 * 32)
    assert [x["step"] for x in read_jsonl(out / "loss.jsonl")] == [1, 10, 20, 25, 26, 30, 40]
    # Batches depend only on (seed, step) and the optimizer state is restored: 25 then 40 == 40 straight.
    resumed, straight = load(out / "model.pt")["model"], load(straight_run[0] / "model.pt")["model"]
    assert load(out / "model.pt")["step"] == 40
    for k, v in straight.items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-4, atol=1e-5)

    # Already at the target (a pod restarted after its final save): exits 0 at once, changes nothing.
    before = {n: (out / n).read_bytes() for n in ("model.pt", "loss.jsonl", "metrics.json")}
    r = run_gpt("--data-prefix", pattern, "--checkpoint-dir", out, "--max-steps", 40, *PATTERN_ARGS)
    assert "nothing to train" in r.stdout and "step 41" not in r.stdout
    assert {n: (out / n).read_bytes() for n in before} == before
    # ... and writes metrics.json when the kill came between the final save and metrics.json.
    (out / "metrics.json").unlink()
    run_gpt("--data-prefix", pattern, "--checkpoint-dir", out, "--max-steps", 30, *PATTERN_ARGS)
    m = json.loads((out / "metrics.json").read_text())
    assert (m["steps"], m["start_step"], m["run_steps"], m["tokens_seen"]) == (40, 40, 0, 40 * 8 * 32)
    assert (out / "model.pt").read_bytes() == before["model.pt"]

    # --resume-from another run's checkpoint (what the next retraining run does) into a fresh dir:
    # the step carries over, as Lightning's global step does, so the target is past it.
    nxt = tmp_path / "next"
    r = run_gpt(
        "--data-prefix", pattern, "--checkpoint-dir", nxt, "--max-steps", 45, "--resume-from", out, *SMALL
    )
    m = json.loads((nxt / "metrics.json").read_text())
    assert (m["steps"], m["start_step"], m["resumed_from"]) == (45, 40, str(out / "model.pt"))
    assert [x["step"] for x in read_jsonl(nxt / "loss.jsonl")] == [41, 45]
    bad = run_module(
        GPT,
        "--data-prefix",
        pattern,
        "--checkpoint-dir",
        tmp_path / "x",
        "--d-model",
        "64",
        "--resume-from",
        out,
        "--max-steps",
        "1",
    )
    assert bad.returncode == 2 and "differs from the checkpoint" in bad.stderr


def test_fresh_model_init_is_normal_002(pattern: Path, tmp_path: Path) -> None:
    out = tmp_path / "init"
    run_gpt(
        "--data-prefix",
        pattern,
        "--checkpoint-dir",
        out,
        "--max-steps",
        0,
        "--d-model",
        "128",
        "--layers",
        "2",
        "--heads",
        "4",
        "--vocab-size",
        "4096",
    )
    state = load(out / "model.pt")["model"]
    assert isinstance(state, dict)
    assert "tok.weight" in state and not any("head" in k for k in state)  # output head tied to tok
    weights = {k: v for k, v in state.items() if k.endswith("weight") and "ln" not in k}
    assert {k.rsplit(".", 1)[0].split(".")[-1] for k in weights} == {"tok", "pos", "qkv", "proj", "fc", "out"}
    for k, v in weights.items():
        assert float(v.std()) == pytest.approx(0.02, rel=0.1), k
        assert abs(float(v.mean())) < 0.003, k
    for k, v in state.items():
        if k.endswith("bias"):
            assert torch.count_nonzero(v) == 0, k
        if "ln" in k and k.endswith("weight"):
            assert torch.all(v == 1), k
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 0 and m["final_loss"] is None and m["config"]["vocab_size"] == 4096


def test_fused_head_loss_equals_cross_entropy() -> None:
    from retrain.train.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, seq_len=16, d_model=32, layers=1, heads=2))
    x = torch.randint(0, 300, (3, 17))
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 300), x[:, 1:].reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-6)


def test_weighted_blend_trains(tmp_path: Path) -> None:
    a = write_dataset(tmp_path / "a", pattern_documents(5))
    b = write_dataset(tmp_path / "b", random_documents(10, 100, seed=4))
    out = tmp_path / "ckpt"
    r = run_gpt("--data-prefix", "0.7", a, "0.3", b, "--checkpoint-dir", out, "--max-steps", 3, *SMALL)
    assert "2 dataset(s)" in r.stdout
    assert json.loads((out / "metrics.json").read_text())["config"]["vocab_size"] == 128


def test_unreadable_data_exits_with_a_clear_message(tmp_path: Path) -> None:
    bad = write_dataset(tmp_path / "bad", random_documents(3, 100))
    Path(str(bad) + ".bin").write_bytes(b"\x00" * 6)
    r = run_module(GPT, "--data-prefix", bad, "--checkpoint-dir", tmp_path / "c", "--max-steps", "2", *SMALL)
    assert r.returncode == 2 and f"dataset {bad}" in r.stderr and "Traceback" not in r.stderr
    r = run_module(GPT, "--data-prefix", tmp_path / "nothing", "--checkpoint-dir", tmp_path / "c")
    assert r.returncode == 2 and "does not exist" in r.stderr
    assert not (tmp_path / "c" / "metrics.json").exists()


def test_two_process_gloo_run_writes_from_rank_0_only(pattern: Path, tmp_path: Path) -> None:
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = child_env(
            WORLD_SIZE="2",
            RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RETRAIN_DIST_TIMEOUT_S="60",
        )
        args = [
            "--data-prefix",
            pattern,
            "--checkpoint-dir",
            tmp_path / f"rank{rank}",
            "--max-steps",
            "6",
            *SMALL,
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", GPT, *map(str, args)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120))
        finally:
            p.kill()
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert "batch 8x2" in outs[0][0] and "step 6/6" in outs[0][0]
    assert outs[1][0] == ""  # rank 1 neither prints nor writes
    assert not (tmp_path / "rank1").exists()
    m = json.loads((tmp_path / "rank0" / "metrics.json").read_text())
    assert (m["world_size"], m["steps"], m["tokens_seen"]) == (2, 6, 6 * 8 * 32 * 2)


def test_gcs_data_and_checkpoint_dir(pattern: Path, gcs_emulator: str) -> None:
    for ext in (".bin", ".idx"):
        objects.upload_file(str(pattern) + ext, "gs://b/shards/p/data_text_document" + ext)
    objects.write_bytes(
        "gs://b/runs/r1/tokenize_report.json",
        json.dumps({"data_prefix_blend": [1.0, "gs://b/shards/p/data_text_document"]}).encode(),
    )
    from retrain.train import trainer_command

    argv = trainer_command("gpt", ["@gs://b/runs/r1/tokenize_report.json"], "gs://b/runs/r1/ckpt", 4)
    env = child_env()
    run_gpt(*argv[3:], *SMALL, "--log-every", "2", env=env)
    for name in ("model.pt", "loss.jsonl", "metrics.json"):
        assert objects.exists(f"gs://b/runs/r1/ckpt/{name}"), name
    run_gpt(*argv[3:-1], "7", *SMALL, "--log-every", "2", env=env)  # same dir: resumes at step 4
    m = json.loads(objects.read_bytes("gs://b/runs/r1/ckpt/metrics.json"))
    assert (m["steps"], m["start_step"], m["checkpoint"]) == (7, 4, "gs://b/runs/r1/ckpt/model.pt")
    lines = objects.read_bytes("gs://b/runs/r1/ckpt/loss.jsonl").decode().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 4, 5, 6, 7]


def test_checkpoint_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from retrain.train import gpt

    assert gpt.parser().parse_args(["--data-prefix", "x"]).save_every == gpt.DEFAULT_SAVE_EVERY == 20
    uri = str(tmp_path / "ckpt" / "model.pt")
    gpt.save_checkpoint(uri, {"step": 20, "w": torch.ones(3)})
    good = Path(uri).read_bytes()
    real_save = torch.save

    def killed_mid_save(obj: Any, f: Any) -> None:
        real_save(obj, f)
        f.truncate(10)  # half a file on disk, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_mid_save)
    with pytest.raises(KeyboardInterrupt):
        gpt.save_checkpoint(uri, {"step": 40, "w": torch.zeros(3)})
    assert Path(uri).read_bytes() == good and load(Path(uri))["step"] == 20
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["model.pt"]
    # A SIGKILL leaves the temporary file behind: the next run discards it, never model.pt.
    (tmp_path / "ckpt" / ".model.pt.123-abcd.tmp").write_bytes(b"torn")
    gpt.discard_partial_saves(uri)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["model.pt"]
