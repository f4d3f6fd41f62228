"""A stand-in ``torchrun`` for the local image where PyTorch is not installed.

It launches ``--nproc-per-node`` copies of a script the way torchrun's static rendezvous does, with
``RANK`` = node rank x processes per node + local rank, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and exits with the first
failure's code (0 when every process succeeds).  Only what the JobSet's launcher passes is accepted.

Given a fork server (:mod:`retrain_local.forkserver`, started with :data:`RANK_PRELOAD`), it forks each
process from that warm interpreter instead of starting a fresh one: the same script, arguments,
environment and output, without each rank's own ``import torch``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from retrain_local import forkserver

#: What a stand-in rank imports before its first step (PyTorch, its process group, the stand-in trainers
#: and Hydra's composition): what a fork server for ranks imports once.
RANK_PRELOAD = (
    "torch",
    "torch.distributed",
    "retrain.trainers.hydra",
    "retrain_local.train.gpt",
    "retrain_local.train.standin",
    "retrain_local.train.bridge_standin",
)


def rank_fork_server(log_path: Path) -> forkserver.ForkServer:
    """The fork server (not started) the stand-in images' ranks fork from: :data:`RANK_PRELOAD` imported
    once, with the images' own environment (``retrain_local.images.STANDIN_ENV``) set before PyTorch
    loads, since a forked rank inherits the OpenMP PyTorch loaded in the server."""
    from retrain_local.images import STANDIN_ENV

    return forkserver.ForkServer(RANK_PRELOAD, log_path, env=STANDIN_ENV)


class _Process(Protocol):
    def wait(self) -> int: ...


def main(argv: list[str] | None = None, fork_server: Path | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchrun")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, required=True)
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", dest="master_port", default="29500")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    world = a.nnodes * a.nproc
    procs: list[_Process] = []
    for local in range(a.nproc):
        env = {
            **os.environ,
            "RANK": str(a.node_rank * a.nproc + local),
            "LOCAL_RANK": str(local),
            "GROUP_RANK": str(a.node_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(a.nproc),
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
        }
        proc: _Process
        if fork_server is not None:
            proc = forkserver.Child(fork_server, [a.script, *a.args], env)
        else:
            proc = subprocess.Popen([sys.executable, a.script, *a.args], env=env)
        procs.append(proc)
    codes = [proc.wait() for proc in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    raise SystemExit(main())
