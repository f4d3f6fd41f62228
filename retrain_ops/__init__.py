"""The operator's command line and tooling: ``retrain`` (cli), deploying (deploy, builds, pins, targets),
reading the deployment's Terraform (hcl, deployment) and Kubernetes manifests (manifests, render,
k8s_schema), and what an operator reads of a run (report, doctor, reap).  Nothing here ships to the
functions or the images; ``cli`` alone starts the local stack (``retrain up``, ``retrain demo``).
"""
