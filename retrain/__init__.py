"""retrain's runtime: what the Cloud Functions, the workflow's steps and the in-cluster notifier run.

``retrain deploy`` uploads this package whole as the functions' source, and k8s/Dockerfile copies it into
the notifier's image, so it imports none of the project's other packages (tests/test_architecture.py):
``retrain_tokenize`` (the Dataflow job), ``retrain_ops`` (the operator's CLI and tooling),
``retrain_local`` (the local stack) and ``cloudworkflows`` (the Workflows interpreter).
"""
