"""The stand-in's GPT: its initialisation, its fused output-head loss and its atomic checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")


def test_fresh_model_init_is_normal_002() -> None:
    from retrain_local.train.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    state = GPT(GPTConfig(vocab_size=4096, seq_len=128, d_model=128, layers=2, heads=4)).state_dict()
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


def test_fused_head_loss_equals_cross_entropy() -> None:
    from retrain_local.train.gpt import GPT, GPTConfig

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


def test_checkpoint_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from retrain_local.train import gpt

    path = tmp_path / "ckpt" / "model.pt"
    gpt.save_checkpoint(path, {"step": 20, "w": torch.ones(3)})
    good = path.read_bytes()
    real_save = torch.save

    def killed_mid_save(obj: Any, f: Any) -> None:
        real_save(obj, f)
        f.truncate(10)  # half a file on disk, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_mid_save)
    with pytest.raises(KeyboardInterrupt):
        gpt.save_checkpoint(path, {"step": 40, "w": torch.zeros(3)})
    assert path.read_bytes() == good and gpt.load_checkpoint(path)["step"] == 20
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]
    # A SIGKILL leaves the temporary file behind: the next run discards it, never model.pt.
    (path.parent / ".model.pt.123-abcd.tmp").write_bytes(b"torn")
    gpt.discard_partial_saves(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]
