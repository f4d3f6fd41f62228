"""One run's whole life on one page: ``retrain report RUN`` writes it as a single HTML file; a
dataset's history on another (``retrain report --dataset D``).

The page is self-contained (inline CSS and SVG: no script, font or image is fetched), so it can be
mailed, attached to a ticket or opened from a bucket.  It shows the stage timeline (queued, tokenizing,
waiting for capacity, training, releasing, each with its duration), the loss curve from the trainer's
TensorBoard scalars, tokens, GPU node time busy and idle, cost against the estimate and the cap, the
lineage (snapshot, objects, base checkpoint to new checkpoint) and the eval gate's verdict.  Every value
from the record is escaped: object names and reasons are data, never markup.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

from retrain.config import Settings
from retrain.domain.runs import DEFAULT_PROFILE, Run, RunStatus, parse_iso
from retrain.lineage import LINEAGE_OBJECT
from retrain.plan import run_root, training_plan
from retrain.ports import ObjectStore
from retrain.steps import trainer_outputs
from retrain.tensorboard import Scalar
from retrain.trainers import profile

#: Stage colours, in timeline order (also what a screenshot test looks for).
STAGE_COLOURS = {
    "queued": "#9aa5b1",
    "tokenizing": "#f0a202",
    "waiting for capacity": "#d1495b",
    "training": "#2e86ab",
    "releasing": "#6a4c93",
}
TRAIN_LOSS_COLOUR = "#1b998b"
VAL_LOSS_COLOUR = "#ff6f00"


@dataclass(frozen=True)
class Stage:
    """One stretch of the run's life."""

    name: str
    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return max(0.0, (self.end - self.start).total_seconds())


def stages(run: Run) -> list[Stage]:
    """The stages the record has times for; each ends where the next known one begins (a run that failed
    while tokenizing goes from tokenizing straight to releasing)."""
    marks = [
        ("queued", run.created_at),
        ("tokenizing", run.tokenizing_at),
        ("waiting for capacity", run.provisioning_at),
        ("training", run.training_at),
        ("releasing", run.work_ended_at),
        ("", run.finished_at),
    ]
    known = [(name, t) for name, text in marks if (t := parse_iso(text)) is not None]
    if not run.status.terminal and known and known[-1][0]:  # a live run: its stage goes on until now
        known.append(("", datetime.now(UTC)))
    return [Stage(name, start, end) for (name, start), (_, end) in pairwise(known) if name]


def duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def timeline_svg(parts: Sequence[Stage], width: int = 720) -> str:
    total = sum(s.seconds for s in parts) or 1.0
    x, bars = 0.0, []
    for s in parts:
        w = max(2.0, s.seconds / total * width)
        colour = STAGE_COLOURS[s.name]
        label = html.escape(f"{s.name}: {duration(s.seconds)}")
        box = f'x="{x:.1f}" y="0" width="{w:.1f}" height="28" fill="{colour}"'
        bars.append(f"<rect {box}><title>{label}</title></rect>")
        x += w
    return f'<svg class="timeline" width="{width}" height="28" viewBox="0 0 {x:.1f} 28">{"".join(bars)}</svg>'


def loss_svg(scalars: Sequence[Scalar], width: int = 720, height: int = 280) -> str:
    """Training loss as a line and validation loss as dots, over the optimizer step."""
    series = {  # a diverged run logs nan or inf: those points cannot be drawn
        tag: sorted((s.step, s.value) for s in scalars if s.tag == tag and math.isfinite(s.value))
        for tag in ("reduced_train_loss", "val_loss")
    }
    points = [p for values in series.values() for p in values]
    if not points:
        return '<p class="muted">No loss curve: the trainer left no TensorBoard loss scalars.</p>'
    pad_l, pad_r, pad_t, pad_b = 56, 16, 12, 36
    steps = [p[0] for p in points]
    losses = [p[1] for p in points]
    s0, s1 = min(steps), max(steps)
    l0, l1 = min(losses), max(losses)
    s1, l1 = (s1 if s1 > s0 else s0 + 1), (l1 if l1 > l0 else l0 + 1)

    def xy(step: float, loss: float) -> tuple[float, float]:
        x = pad_l + (step - s0) / (s1 - s0) * (width - pad_l - pad_r)
        y = pad_t + (l1 - loss) / (l1 - l0) * (height - pad_t - pad_b)
        return x, y

    parts = [
        f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - pad_r}" y2="{height - pad_b}" '
        'stroke="#444"/>',
        f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" stroke="#444"/>',
        f'<text x="{pad_l - 6}" y="{pad_t + 10}" text-anchor="end">{l1:.3f}</text>',
        f'<text x="{pad_l - 6}" y="{height - pad_b}" text-anchor="end">{l0:.3f}</text>',
        f'<text x="{pad_l}" y="{height - 14}">step {s0}</text>',
        f'<text x="{width - pad_r}" y="{height - 14}" text-anchor="end">step {s1}</text>',
    ]
    train = series["reduced_train_loss"]
    if train:
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(*p) for p in train))
        line = f'fill="none" stroke="{TRAIN_LOSS_COLOUR}" stroke-width="3"'
        parts.append(f'<polyline {line} points="{path}"/>')
    for p in series["val_loss"]:
        x, y = xy(*p)
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="{VAL_LOSS_COLOUR}"/>')
    return f'<svg class="loss" width="{width}" height="{height}">{"".join(parts)}</svg>'


def _or_none(value: object) -> object:
    return "none" if value is None else value


def _rows(rows: Sequence[tuple[str, object]]) -> str:
    return "".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(str(value))}</td></tr>"
        for label, value in rows
        if value not in (None, "")
    )


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 780px; color: #1d232a; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
.status { display: inline-block; padding: 2px 10px; border-radius: 10px; color: #fff; font-weight: 600; }
.succeeded { background: #2a9d55; } .failed { background: #c0392b; } .cancelled { background: #7f8c8d; }
.other { background: #2e86ab; }
table { border-collapse: collapse; width: 100%; } th { text-align: left; width: 34%; color: #52606d; }
th, td { padding: 4px 8px; border-bottom: 1px solid #e4e7eb; vertical-align: top; word-break: break-all; }
.legend span { display: inline-block; margin-right: 14px; } .legend i { display: inline-block; width: 12px;
  height: 12px; margin-right: 4px; vertical-align: -1px; }
svg text { font-size: 12px; fill: #52606d; } .muted { color: #7b8794; }
code { font: 12px/1.4 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
"""


def lineage_rows(events: Sequence[dict[str, Any]]) -> str:
    """The run's OpenLineage events (``retrain.lineage``) as table rows: what each said, and which
    datasets it named."""
    out = []
    for event in events:
        named = [
            f"{d.get('namespace')}/{d.get('name')}"
            for d in event.get("inputs", []) + event.get("outputs", [])
        ]
        said = f"{len(event.get('inputs', []))} in, {len(event.get('outputs', []))} out" if named else ""
        title = html.escape("\n".join(named))
        out.append(
            f"<tr><th>{html.escape(str(event.get('eventType')))}</th>"
            f'<td title="{title}">{html.escape(str(event.get("eventTime")))} {html.escape(said)}</td></tr>'
        )
    return "".join(out)


def render(run: Run, scalars: Sequence[Scalar], openlineage: Sequence[dict[str, Any]] = ()) -> str:
    """The run's page, as one HTML document (``openlineage``: its OpenLineage events, once it ended)."""
    e = html.escape
    parts = stages(run)
    legend = "".join(
        f'<span><i style="background:{STAGE_COLOURS[s.name]}"></i>{e(s.name)} {e(duration(s.seconds))}</span>'
        for s in parts
    )
    metrics = run.metrics
    busy = run.gpu_node_seconds - run.idle_node_seconds
    verdict = run.eval
    status_class = str(run.status) if str(run.status) in ("succeeded", "failed", "cancelled") else "other"
    cap = f"${run.cost_cap_usd:.2f}" if run.cost_cap_usd else "none"  # the cap it started under
    numbers = _rows(
        [
            ("objects", run.objects),
            ("documents written", run.documents),
            ("tokens written", run.tokens),
            ("records quarantined", run.quarantined),
            ("tokens trained (with the base's)", metrics.tokens_seen if metrics else None),
            ("steps (this run)", f"{metrics.steps} ({metrics.run_steps})" if metrics else None),
            ("GPU node-seconds busy", f"{busy:.1f}"),
            ("GPU node-seconds idle", f"{run.idle_node_seconds:.1f}"),
            ("cost of node time", f"${run.cost_usd:.2f}"),
            ("priced at start", None if run.estimated_cost_usd is None else f"${run.estimated_cost_usd:.2f}"),
            ("per-run cap", cap),
        ]
    )
    lineage = _rows(
        [
            ("snapshot", run.snapshot),
            ("first batch", run.batch_id),
            ("base checkpoint", run.base_checkpoint or "none: the dataset's first run"),
            ("base step", run.base_step),
            ("new checkpoint", run.checkpoint),
            ("promoted", None if verdict is None else ("yes" if verdict.promoted else "no")),
        ]
    )
    evaluation = (
        _rows(
            [
                ("val_loss", _or_none(verdict.val_loss)),
                ("champion's val_loss", _or_none(verdict.champion_val_loss)),
                ("measured on", verdict.compared_on),
                ("champion run", verdict.champion_run),
                ("verdict", verdict.reason),
            ]
        )
        if verdict
        else ""
    )
    command = " ".join(run.command or [])
    about = [
        ("dataset", run.dataset),
        ("trigger", run.triggered_by),
        ("profile", run.profile),
        ("image", run.image),
    ]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>retrain run {e(run.run_id)}</title>
<style>{CSS}</style></head><body>
<h1>Run {e(run.run_id)} <span class="status {status_class}">{e(str(run.status))}</span></h1>
<div class="muted">{" · ".join(e(f"{k} {v}") for k, v in about if v)}</div>
{f"<p><b>Reason:</b> {e(run.reason)}</p>" if run.reason else ""}
<h2>Timeline ({e(duration(sum(s.seconds for s in parts)))})</h2>
{timeline_svg(parts) if parts else '<p class="muted">No stage times recorded.</p>'}
<div class="legend">{legend}</div>
<h2>Loss</h2>
{loss_svg(scalars)}
<div class="legend"><span><i style="background:{TRAIN_LOSS_COLOUR}"></i>training loss</span>
<span><i style="background:{VAL_LOSS_COLOUR}"></i>validation loss</span></div>
<h2>Tokens, GPU time and cost</h2><table>{numbers}</table>
<h2>Lineage</h2><table>{lineage}</table>
<h2>Evaluation against the champion</h2>
{f"<table>{evaluation}</table>" if verdict else '<p class="muted">No evaluation: no checkpoint to judge.</p>'}
<h2>OpenLineage events</h2>
{f"<table>{lineage_rows(openlineage)}</table>" if openlineage else '<p class="muted">None yet.</p>'}
<h2>Command</h2><code>{e(command) or "none"}</code>
</body></html>
"""


def write_report(settings: Settings, store: ObjectStore, run: Run, path: Path) -> Path:
    """Render ``run``'s page with the loss curve its trainer left (read through ``store``) to ``path``."""
    try:
        events = json.loads(store.read_bytes(f"{run_root(settings, run.run_id)}/{LINEAGE_OBJECT}"))
    except (FileNotFoundError, ValueError):
        events = []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(run, _scalars_of(settings, store, run), events), encoding="utf-8")
    return path


# --- a dataset's history: retrain report --dataset D --------------------------------------------------


def champion_chain(runs: Sequence[Run]) -> list[Run]:
    """The dataset's promoted runs, oldest first: each continued from the one before (its base checkpoint)."""
    return sorted((r for r in runs if r.promoted), key=lambda r: r.created_at)


def bars_svg(values: Sequence[tuple[str, float]], colour: str, unit: str, width: int = 720) -> str:
    """One bar per run (oldest left), its value in its tooltip."""
    if not values:
        return '<p class="muted">No runs.</p>'
    top = max(v for _, v in values) or 1.0
    step = width / len(values)
    bars = []
    for i, (label, v) in enumerate(values):
        h = max(1.0, v / top * 80)
        tip = html.escape(f"{label}: {v:,.2f} {unit}")
        bars.append(
            f'<rect x="{i * step + 1:.1f}" y="{90 - h:.1f}" width="{max(1.0, step - 2):.1f}" '
            f'height="{h:.1f}" fill="{colour}"><title>{tip}</title></rect>'
        )
    return f'<svg class="bars" width="{width}" height="92">{"".join(bars)}</svg>'


def render_dataset(dataset: str, runs: Sequence[Run], curves: Sequence[Scalar]) -> str:
    """A dataset's page: its runs over time (tokens, cost, idle GPU time, time waited for capacity), the
    champion chain with each verdict, and the loss curve of that lineage (each champion's run, at the
    steps it trained)."""
    e = html.escape
    runs = sorted(runs, key=lambda r: r.created_at)
    ended = [r for r in runs if r.status.terminal]
    rows = []
    for r in runs:
        waited = r.waited_for_capacity_s
        verdict = "promoted" if r.promoted else ("not promoted" if r.eval else "")
        said = f"{r.failure}: {r.reason}" if r.failure else (r.reason or "")
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{e(str(v))}</td>"
                for v in (
                    r.run_id,
                    (r.created_at or "")[:16].replace("T", " "),
                    r.status,
                    f"{r.tokens:,}",
                    f"${r.cost_usd:.2f}",
                    duration(r.idle_node_seconds),
                    duration(waited) if waited is not None else "",
                    verdict,
                    said,
                )
            )
            + "</tr>"
        )
    chain = "".join(
        f"<li><b>{e(r.run_id)}</b> from {e(r.base_checkpoint or 'nothing (the first run)')} to "
        f"<code>{e(r.checkpoint or '')}</code>: {e(r.eval.reason if r.eval else '')}</li>"
        for r in champion_chain(runs)
    )
    totals = _rows(
        [
            ("runs", f"{len(runs)} ({sum(r.status == RunStatus.SUCCEEDED for r in runs)} succeeded)"),
            ("tokens written", f"{sum(r.tokens for r in runs):,}"),
            ("cost of node time", f"${sum(r.cost_usd for r in ended):.2f}"),
            ("GPU node-seconds idle", f"{sum(r.idle_node_seconds for r in ended):.1f}"),
        ]
    )
    head = (
        "run",
        "made",
        "status",
        "tokens",
        "cost",
        "idle GPU time",
        "waited for capacity",
        "eval",
        "reason",
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>retrain dataset {e(dataset)}</title>
<style>{CSS}</style></head><body>
<h1>Dataset {e(dataset)}</h1>
<table>{totals}</table>
<h2>Tokens per run</h2>
{bars_svg([(r.run_id, float(r.tokens)) for r in runs], STAGE_COLOURS["tokenizing"], "tokens")}
<h2>Cost per run</h2>
{bars_svg([(r.run_id, r.cost_usd) for r in ended], STAGE_COLOURS["training"], "USD")}
<h2>Runs</h2>
<table class="runs"><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr>{"".join(rows)}</table>
<h2>Champion chain</h2>
{f"<ol>{chain}</ol>" if chain else '<p class="muted">No checkpoint promoted yet.</p>'}
<h2>Loss along the lineage</h2>
{loss_svg(curves)}
<div class="legend"><span><i style="background:{TRAIN_LOSS_COLOUR}"></i>training loss</span>
<span><i style="background:{VAL_LOSS_COLOUR}"></i>validation loss</span></div>
</body></html>
"""


def _scalars_of(settings: Settings, store: ObjectStore, run: Run) -> list[Scalar]:
    """The loss scalars ``run``'s trainer left, at the lineage's steps (its base step on)."""
    trainer = profile(run.profile or DEFAULT_PROFILE)  # a record without one was NeMo's, the only one then
    plan = replace(
        training_plan(settings, run.run_id, None), base_step=run.base_step or 0, profile=trainer.name
    )
    scalars, _ = trainer_outputs(store, trainer.run_dir(plan))
    return trainer.lineage_scalars(scalars, plan)


def write_dataset_report(
    settings: Settings, store: ObjectStore, dataset: str, runs: Sequence[Run], path: Path
) -> Path:
    """Render ``dataset``'s page from its runs (the loss curves of its champion chain read through
    ``store``) to ``path``."""
    curves = [s for r in champion_chain(runs) for s in _scalars_of(settings, store, r)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_dataset(dataset, runs, curves), encoding="utf-8")
    return path
