"""The completion relay: a JobSet's terminal state, from the notifier through Pub/Sub, confirmed against the
run and the JobSet itself and relayed to the run's waiting workflow callback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retrain.contracts import CallbackPayload, JobSetCompletion
from retrain.domain.errors import Rejected, Retry
from retrain.ingest.context import Job
from retrain.ingest.outcomes import Action, Outcome


class Relay(Job):
    """JobSet completions, confirmed, to the waiting execution's callback."""

    def on_jobset_event(self, message: Mapping[str, Any]) -> Outcome:
        """Relay a JobSet terminal state (a :class:`JobSetCompletion` from the notifier) to its run's
        workflow callback (as a :class:`CallbackPayload`), once confirmed: the message must name a live
        run, that run's own callback, and a JobSet that exists, carries the run's label and the message's
        uid, and has the terminal state the message says.  Anything else is Rejected with its reason
        (the workflow confirms again from the JobSet before acting: a message is only ever a hint)."""
        completion = JobSetCompletion.parse(message)
        run = self.ledger.get_run(completion.run_id)
        if run is None:
            raise Rejected(f"JobSet event names run {completion.run_id!r}, which does not exist")
        if run.status.terminal:
            return Outcome(Action.IGNORED, f"run {run.run_id} already ended {run.status}", run.run_id)
        if not run.callback_url:
            raise Rejected(f"run {run.run_id} has no callback endpoint")
        if completion.callback_url and completion.callback_url != run.callback_url:
            raise Rejected(f"JobSet event names a callback that is not run {run.run_id}'s")
        self._confirm(completion)
        url = run.callback_url
        try:
            status = self.orchestrator.send_callback(url, CallbackPayload.of(completion).to_dict())
        except ValueError as e:
            raise Rejected(str(e)) from None
        if status == 404:
            # The execution is gone (finished, cancelled or timed out): nothing waits, so acknowledge.
            return Outcome(Action.IGNORED, f"callback {url} no longer exists")
        if status >= 300:
            raise Retry(f"callback {url} answered {status}")
        return Outcome(Action.RELAYED, str(completion.state), completion.run_id)

    def _confirm(self, completion: JobSetCompletion) -> None:
        """The JobSet the message names is the run's, and in the state the message says; else Rejected."""
        if self.cluster is None:
            raise Retry("confirming a completion needs the cluster, and none is configured")
        ref = completion.jobset
        if ref.namespace and ref.namespace != self.settings.namespace:
            raise Rejected(f"JobSet {ref.name} is in namespace {ref.namespace!r}, not retrain's")
        problem = self.cluster.confirm_completion(
            self.settings.namespace, ref.name, ref.uid, completion.run_id, str(completion.state)
        )
        if problem:
            raise Rejected(problem)
