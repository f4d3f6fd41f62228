"""The local stack's endpoints file (``.retrain/stack.json``), read by every CLI command that attaches."""

from __future__ import annotations

import json
from pathlib import Path

from retrain_local.stack import Endpoints


def test_a_stack_file_an_older_retrain_wrote_still_loads(tmp_path: Path) -> None:
    """`retrain down` after an upgrade: the endpoints file of a stack started before it (which had a
    KUBECONFIG entry) still loads, so the stack can be stopped by its pid."""
    path = tmp_path / "stack.json"
    path.write_text(json.dumps({"pid": 4242, "firestore": "127.0.0.1:1", "kubeconfig": "/old/kubeconfig"}))
    loaded = Endpoints.load(path)
    assert (loaded.pid, loaded.firestore, loaded.container) == (4242, "127.0.0.1:1", "")
