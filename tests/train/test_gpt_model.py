"""The stand-in's GPT: its initialisation, its fused output-head loss and its atomic checkpoints."""

from __future__ import annotations

import copy
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


def test_the_written_out_adamw_steps_as_torch_optims_and_resumes_from_its_state() -> None:
    """The stand-ins' AdamW (written out: torch.optim's imports torch._dynamo, 2.5 s of CPU a rank) moves
    the weights as torch.optim.AdamW does, and a state it saved, or torch.optim's, resumes the same."""
    from retrain_local.train.gpt import GPT, GPTConfig
    from retrain_local.train.loop import AdamW

    def model() -> Any:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, layers=1, heads=2))

    def train(net: Any, opt: Any, steps: range) -> None:
        for step in steps:
            opt.param_groups[0]["lr"] = 1e-2 * (step + 1)
            opt.zero_grad(set_to_none=True)
            batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
            net(batch[:, :-1], batch[:, 1:]).backward()
            opt.step()

    theirs, ours = model(), model()
    reference = torch.optim.AdamW(theirs.parameters(), lr=0.0, weight_decay=0.1, betas=(0.9, 0.95))
    written = AdamW(torch, list(ours.parameters()), 0.1, (0.9, 0.95))
    train(theirs, reference, range(3))
    train(ours, written, range(3))
    for (name, a), b in zip(theirs.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name

    saved = {"torch.optim's": copy.deepcopy(reference.state_dict()), "its own": written.state_dict()}
    resumed = {}
    for label, state in saved.items():  # a new optimizer from a saved state, three steps more
        net = model()
        net.load_state_dict(ours.state_dict())
        again = AdamW(torch, list(net.parameters()), 0.1, (0.9, 0.95))
        again.load_state_dict(copy.deepcopy(state))
        train(net, again, range(3, 6))
        resumed[label] = net
    train(theirs, reference, range(3, 6))
    for label, net in resumed.items():
        for (name, a), b in zip(theirs.state_dict().items(), net.state_dict().values(), strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (label, name)
