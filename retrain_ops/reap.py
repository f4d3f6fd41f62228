"""``retrain reap``: the reaper (:mod:`retrain.k8s.reaper`) run by hand or by a CronJob, against the
cluster and ledger the composition root builds.  Apart from the reaper, which the ``Cluster`` adapter
calls, so that the library never imports the composition root that builds that adapter."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from retrain.k8s.reaper import default_max_age_s, render_text


def main(argv: list[str] | None = None) -> int:
    """``retrain reap``: exit 0, 3 when GPU nodes are up with no live run, 1 when a delete failed."""
    from retrain.config import load

    settings = load()
    p = argparse.ArgumentParser(
        prog="retrain reap",
        description="Delete the JobSets, ProvisioningRequests and PodTemplates of runs that are over "
        "(or unknown to the ledger, or older than the max age) and report GPU nodes still up.",
    )
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--max-age-hours",
        type=float,
        default=default_max_age_s(settings) / 3600,
        help="a run older than this is stuck and its objects are reaped "
        "(default: provisioning + training timeouts + 2 h = %(default).1f)",
    )
    p.add_argument("--namespace", default=settings.namespace)
    p.add_argument("--node-pool", default=settings.node_pool)
    p.add_argument("--project", default=settings.project, help="project of the Firestore ledger")
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="reach the cluster through this kubeconfig instead of finding it with the GKE API",
    )
    args = p.parse_args(argv)
    if args.max_age_hours <= 0:
        p.error("--max-age-hours must be positive")

    from retrain import composition

    settings = dataclasses.replace(
        settings, project=args.project, namespace=args.namespace, node_pool=args.node_pool
    )
    ledger = composition.ledger(settings)
    report = composition.cluster(settings).reap_report(
        ledger, max_age_s=args.max_age_hours * 3600, dry_run=args.dry_run, kubeconfig=args.kubeconfig
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for line in render_text(report):
            print(line)
    sys.stdout.flush()
    return report.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
