"""The deployment's serverless side as the local stack plays it: the functions (each served as its own
identity behind Cloud Run's invoker check), the workflow's executions service (checking its callers as
Workflows does), and the push subscriptions that reach the functions (infra/app/events.tf)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrain import config
from retrain_local import delivery, emulators
from retrain_local.forkserver import ForkServer
from retrain_local.iam import Kind, Resource
from retrain_local.identities import Deployed, Guard
from retrain_local.invoker_front import InvokerFront

if TYPE_CHECKING:
    from cloudworkflows import ConnectorRegistry, ExecutionsServer
    from retrain_local.stack import LocalStack

REPO_ROOT = Path(__file__).resolve().parents[1]

#: functions-framework serving the deployed source (on PYTHONPATH) and nothing of this checkout: not its
#: folder, not its editable install, not a module of it already imported (a function forked from a warm
#: interpreter, :func:`function_fork_server`, comes with the fork server's own); PYTHONPATH's folders
#: first, as a fresh interpreter has them (a forked one was given the variable after it started).
AS_DEPLOYED = (
    "import os, runpy, sys, sysconfig\n"
    "here = [os.path.dirname(os.path.realpath(__file__))] if '__file__' in globals() else []\n"
    "first = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]\n"
    "sys.path[:] = first + [p for p in sys.path if p not in ('', os.getcwd(), *here, *first)]\n"
    "editable = lambda f: getattr(f, '__module__', '').startswith('__editable__')\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]\n"
    "sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]\n"
    "sys.path_importer_cache.clear()\n"
    "lib = tuple(sysconfig.get_paths()[k] for k in ('stdlib', 'platstdlib', 'purelib', 'platlib'))\n"
    "for name, module in list(sys.modules.items()):\n"
    "    file = getattr(module, '__file__', None)\n"
    "    if name != '__main__' and file and not file.startswith(lib):\n"
    "        del sys.modules[name]\n"
    "runpy.run_module('functions_framework', run_name='__main__', alter_sys=True)\n"
)

#: What a function imports beside its own source: functions-framework's servers and the clients retrain's
#: adapters build.  A fork server for functions imports them once per stack (some 4 CPU s), and each
#: function forked from it imports only the deployed source: `run_http` took 0.35 CPU s to serve, the
#: process standing for it included, against 1.2 started afresh, which then imports the clients at its
#: first call.  Third-party modules only: the source itself is imported afresh in every function.
FUNCTION_PRELOAD = (
    "functions_framework",
    "functions_framework.aio",
    "gunicorn.app.base",
    "gunicorn.workers.gthread",
    "uvicorn_worker",
    "cloudevents.http",
    "google.cloud.firestore",
    "google.cloud.pubsub_v1",
    "google.cloud.storage",
    "google.cloud.workflows.executions_v1",
    "google.cloud.container_v1",
    "google.oauth2.id_token",
    "kubernetes.client",
    "hydra",
    "yaml",
)

_built_sources: dict[Path, Path] = {}


def deployed_functions_source(folder: Path) -> Path:
    """The function source as ``retrain deploy`` uploads it (``retrain_ops.deploy.build_functions_source``),
    built once per process into ``folder``/functions-source."""
    from retrain_ops.deploy import build_functions_source

    folder = folder.resolve()
    if folder not in _built_sources:
        _built_sources[folder] = build_functions_source(REPO_ROOT, folder / "functions-source")
    return _built_sources[folder]


def function_fork_server(log_path: Path) -> ForkServer:
    """The fork server (not started) that functions fork from: :data:`FUNCTION_PRELOAD` imported once."""
    return ForkServer(FUNCTION_PRELOAD, log_path)


def _launcher(folder: Path) -> Path:
    """:data:`AS_DEPLOYED` as a script (what a fork server runs), in a folder of its own under ``folder``."""
    script = folder.resolve() / "functions-launcher" / "functions_framework_as_deployed.py"
    if not script.is_file() or script.read_text() != AS_DEPLOYED:
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(AS_DEPLOYED)
    return script


def function_server(
    target: str,
    log_path: Path,
    env: dict[str, str],
    signature: str,
    port: int,
    forks: ForkServer | None = None,
) -> tuple[emulators.ManagedProcess, str]:
    """A function of the deployed source (functions/main.py and the runtime package, built next to
    ``log_path``), served on ``port`` by the real functions-framework; returns it and its URL.  Given a
    :func:`function_fork_server`, it is forked from there (the process started stands for it:
    ``retrain_local.forkserver.run_forked``), else started afresh."""
    source = deployed_functions_source(log_path.parent)
    launch = (
        [sys.executable, "-c", AS_DEPLOYED]
        if forks is None
        else [
            sys.executable,
            "-m",
            "retrain_local.forkserver",
            "--run",
            str(forks.socket_path),
            str(_launcher(log_path.parent)),
        ]
    )
    argv = [
        *launch,
        "--source",
        str(source / "main.py"),
        "--target",
        target,
        "--signature-type",
        signature,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(source), inherited]))}
    url = f"http://127.0.0.1:{port}"
    return emulators.ManagedProcess(f"function-{target}", argv, log_path, None, env, probe_url=url + "/"), url


class Functions:
    """The stack's Cloud Functions: each served as its own identity (infra/'s service account for it), behind
    Cloud Run's invoker check, reached by the push subscriptions routed to it."""

    def __init__(self, stack: LocalStack, deployed: Deployed) -> None:
        self.stack, self.deployed = stack, deployed
        self.forks = function_fork_server(stack.state_dir / "function-fork-server.log").start()
        """What the functions fork from: it imports their libraries while the rest of the stack starts."""
        stack.lifetime.on_stop(self.forks.stop)
        self.env = {**config.to_env(stack.settings), "PYTHONUNBUFFERED": "1"}
        """What every function starts with (the executions service's endpoints join once it serves)."""
        self.fronts: dict[str, str] = {}  # function -> its invoker front's URL
        self.push_routes: dict[str, str] = {}  # topic id -> the function its push subscription reaches

    def serve(self, target: str, signature: str = "cloudevent") -> str:
        """Start ``target`` and its invoker front; the front's URL."""
        stack, function = self.stack, self.deployed.functions[target]
        env = {**self.env, **stack.identity_env(function.member)}
        log = stack.state_dir / f"function-{target}.log"
        _, url = stack.lifetime.spawn_on_a_free_port(
            lambda port: function_server(target, log, env, signature, port, self.forks)
        )
        pushed = {t: p.member for t, p in self.deployed.pushes.items() if self.push_routes.get(t) == target}
        front = InvokerFront(
            url,
            function.service,
            stack.guard,
            trigger_member=function.trigger_member,
            storage_agent=self.deployed.storage_agent if target == "on_object_finalized" else None,
            push_members=pushed,
        ).start()
        stack.lifetime.on_stop(front.stop)
        self.fronts[target] = front.url
        return front.url


def executions_service(
    workflow_file: Path, registry: ConnectorRegistry, env: Mapping[str, str], guard: Guard
) -> ExecutionsServer:
    """The executions service (started) that runs ``workflow_file`` with ``registry``'s connectors, each
    caller checked for the Workflows permission its request needs."""
    from cloudworkflows import ExecutionsServer, load_workflow

    workflow = load_workflow(workflow_file)
    return ExecutionsServer(
        lambda _name: workflow,
        registry,
        env,
        authorize=lambda token, permission, name: guard.authorize(
            token, permission, Resource(Kind.WORKFLOW, name)
        ),
    ).start()


def push_subscription(
    subscriber: Any,
    publisher: Any,
    deployed: Deployed,
    guard: Guard,
    source: str,
    endpoint: str,
    dead_letters: str,
) -> None:
    """``source``'s push subscription as infra/app/events.tf declares it (its name, who pushes, where its
    dead letters go), pushing to ``endpoint``."""
    topic_id = source.rsplit("/", 1)[-1]
    push = deployed.pushes[topic_id]
    # dead-letter forwarding is Pub/Sub's agent's: publish on the dead-letter topic, consume on the
    # subscription (cloud.google.com/pubsub/docs/handling-failures#grant_forwarding_permissions)
    guard.check(deployed.pubsub_agent, "pubsub.topics.publish", Resource(Kind.TOPIC, push.dead_letter_topic))
    guard.check(deployed.pubsub_agent, "pubsub.subscriptions.consume", Resource(Kind.SUBSCRIPTION, push.name))
    project = source.split("/")[1]
    name = f"projects/{project}/subscriptions/{push.name}"
    delivery.push_subscription(subscriber, publisher, source, endpoint, dead_letters, name=name)
