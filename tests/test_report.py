"""``retrain report``: one run's page, rendered by headless Chromium and looked at as a person would
(a screenshot, its colours counted), and hostile record values shown as text, never as markup."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from retrain.domain.runs import Run, RunStatus
from retrain.tensorboard import Scalar
from retrain_ops.report import (
    STAGE_COLOURS,
    TRAIN_LOSS_COLOUR,
    VAL_LOSS_COLOUR,
    champion_chain,
    render,
    render_dataset,
    stages,
)


def a_run(**override: object) -> Run:
    fields: dict[str, object] = {
        "run_id": "news-20261124-0001",
        "dataset": "news",
        "trigger": "gcs-marker",
        "status": RunStatus.SUCCEEDED,
        "objects": 3,
        "tokens": 120_000,
        "gpu_node_seconds": 1500.0,
        "idle_node_seconds": 600.0,
        "cost_usd": 36.87,
        "estimated_cost_usd": 23.33,
        "cost_cap_usd": 50.0,
        "metrics": {"steps": 120, "run_steps": 60, "tokens_seen": 983_040},
        "eval": {
            "val_loss": 3.02,
            "champion_val_loss": 3.10,
            "champion_run": "news-20261123-0001",
            "promoted": True,
            "reason": "val_loss 3.0200 is within the margin of the champion's 3.1000",
        },
        "created_at": "2026-11-24T10:00:00+00:00",
        "tokenizing_at": "2026-11-24T10:00:20+00:00",
        "provisioning_at": "2026-11-24T10:02:20+00:00",
        "training_at": "2026-11-24T10:07:20+00:00",
        "work_ended_at": "2026-11-24T10:22:20+00:00",
        "finished_at": "2026-11-24T10:32:20+00:00",
    }
    fields.update(override)
    return Run.from_dict(fields)  # as the ledger stores it


SCALARS = [Scalar("reduced_train_loss", step, 9.0 - step / 20, 0.0) for step in range(60, 121, 5)] + [
    Scalar("val_loss", 90, 5.1, 0.0),
    Scalar("val_loss", 120, 3.02, 0.0),
]


def test_each_stage_lasts_until_the_next_known_one() -> None:
    assert [(s.name, s.seconds) for s in stages(a_run())] == [
        ("queued", 20.0),
        ("tokenizing", 120.0),
        ("waiting for capacity", 300.0),
        ("training", 900.0),
        ("releasing", 600.0),
    ]
    # failed while tokenizing: no capacity was asked for, so tokenizing runs until the release began
    failed = a_run(provisioning_at=None, training_at=None, work_ended_at="2026-11-24T10:01:20+00:00")
    assert [(s.name, s.seconds) for s in stages(failed)] == [
        ("queued", 20.0),
        ("tokenizing", 60.0),
        ("releasing", 1860.0),
    ]


def test_a_live_runs_stage_goes_on_until_now_and_a_diverged_loss_is_left_out() -> None:
    live = a_run(status=RunStatus.TRAINING, work_ended_at=None, finished_at=None)
    assert [s.name for s in stages(live)][-1] == "training"
    page = render(live, [Scalar("reduced_train_loss", 1, float("nan"), 0.0), *SCALARS])
    assert "nan" not in page.split('<svg class="loss"', 1)[1].split("</svg>", 1)[0]
    assert "<td>$50.00</td>" in page  # the cap it started under


def test_record_values_are_text_never_markup() -> None:
    hostile = a_run(
        reason='<script>alert(1)</script>"', command=["bash", "-c", "<img src=x onerror=alert(1)>"]
    )
    page = render(hostile, SCALARS)
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;" in page
    assert re.search(r"<[^>]*\s(src|href)=", page) is None  # self-contained: no tag fetches anything


def screenshot(page: str, tmp_path: Path, height: int = 1400) -> np.ndarray:
    """The page as headless Chromium draws it (RGB pixels)."""
    html_file = tmp_path / "report.html"
    html_file.write_text(page, encoding="utf-8")
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--hide-scrollbars",
            f"--window-size=900,{height}",
            f"--screenshot={shot}",
            html_file.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    from PIL import Image

    with Image.open(shot) as image:
        return np.asarray(image.convert("RGB"))


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium (scripts/test installs it)"
)
@pytest.mark.integration
def test_the_page_renders_in_chromium_with_its_timeline_and_loss_curve(tmp_path: Path) -> None:
    rgb = screenshot(render(a_run(), SCALARS), tmp_path)

    def count(colour: str) -> int:
        return int((rgb == hex_rgb(colour)).all(axis=2).sum())

    # the timeline: every stage's bar is on screen (the shortest, queued for 20 s of 1940, is ~7 px wide
    # by 28 high, plus its legend swatch)
    for name, colour in STAGE_COLOURS.items():
        assert count(colour) >= 150, (name, count(colour))
    # the loss curve: a 3 px line across the plot (its legend swatch alone is 144 px), two validation dots
    assert count(TRAIN_LOSS_COLOUR) >= 1000, count(TRAIN_LOSS_COLOUR)
    assert count(VAL_LOSS_COLOUR) >= 250, count(VAL_LOSS_COLOUR)  # two dots besides the 144 px swatch


# --- a dataset's page --------------------------------------------------------------------------------

FIRST = a_run(run_id="news-1", checkpoint="gs://a/runs/news-1/megatron_gpt/checkpoints/step=60-last")
WAITED = a_run(
    run_id="news-2",
    status=RunStatus.FAILED,
    failure="CapacityTimeout",
    reason="DWS did not provision within 1800 s <b>",
    eval=None,
    tokens=50_000,
    cost_usd=0.0,
    idle_node_seconds=0.0,
    created_at="2026-11-25T10:00:00+00:00",
    provisioning_at="2026-11-25T10:02:00+00:00",
    training_at=None,
    work_ended_at="2026-11-25T10:32:00+00:00",
)
SECOND = a_run(
    run_id="news-3",
    created_at="2026-11-26T10:00:00+00:00",
    base_checkpoint=FIRST.checkpoint,
    checkpoint="gs://a/runs/news-3/megatron_gpt/checkpoints/step=120-last",
    cost_usd=40.0,
)


def test_a_datasets_page_has_its_runs_its_champion_chain_and_its_lineage() -> None:
    page = render_dataset("news", [SECOND, WAITED, FIRST], SCALARS)
    rows = re.findall(r"<tr><td>(news-\d)</td><td>[^<]*</td><td>(\w+)</td>", page)
    assert rows == [("news-1", "succeeded"), ("news-2", "failed"), ("news-3", "succeeded")]  # oldest first
    assert "<td>5 min 00 s</td>" in page  # news-1 waited 10:02:20 to 10:07:20 for capacity
    assert "<td>30 min 00 s</td>" in page  # news-2 waited from 10:02 until it gave up at 10:32
    assert "CapacityTimeout: DWS did not provision within 1800 s &lt;b&gt;" in page  # a reason is text
    assert "1800 s <b>" not in page
    chain = page.split("<h2>Champion chain</h2>", 1)[1].split("</ol>", 1)[0]
    assert chain.index("news-1") < chain.index("news-3") and "news-2" not in chain
    assert f"from {FIRST.checkpoint} to" in chain  # the second champion continued from the first
    assert "<td>$76.87</td>" in page  # the ended runs' cost: 36.87 + 0 + 40
    assert "<polyline" in page  # the lineage's loss curve
    assert [champion_chain([SECOND, WAITED, FIRST])[i].run_id for i in (0, 1)] == ["news-1", "news-3"]
    assert a_run(provisioning_at=None).waited_for_capacity_s is None


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium (scripts/test installs it)"
)
@pytest.mark.integration
def test_a_datasets_page_renders_in_chromium_with_its_bars_and_lineage(tmp_path: Path) -> None:
    rgb = screenshot(render_dataset("news", [FIRST, WAITED, SECOND], SCALARS), tmp_path, height=2400)

    def count(colour: str) -> int:
        return int((rgb == hex_rgb(colour)).all(axis=2).sum())

    # three token bars (the smallest 50,000 of 120,000: a third of 80 px high) and two cost bars
    assert count(STAGE_COLOURS["tokenizing"]) >= 3 * 200, count(STAGE_COLOURS["tokenizing"])
    assert count(STAGE_COLOURS["training"]) >= 2 * 200, count(STAGE_COLOURS["training"])
    assert count(TRAIN_LOSS_COLOUR) >= 1000, count(TRAIN_LOSS_COLOUR)
