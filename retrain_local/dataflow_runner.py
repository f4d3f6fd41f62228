"""The Beam runner a launched program's pipeline meets locally (``retrain_local.dataflow.RUNNER``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from retrain_local.dataflow import JOB_FILE_VAR


class LaunchedJobRunner(FnApiRunner):
    """Runs the pipeline (as the submitted job would run it on workers) and leaves the job file the
    launcher looks for."""

    def run_pipeline(self, pipeline: Any, options: Any) -> Any:
        result = super().run_pipeline(pipeline, options)
        result.wait_until_finish()
        job_file = os.environ.get(JOB_FILE_VAR)
        if job_file:
            Path(job_file).write_text(json.dumps({"state": str(result.state)}))
        return result
