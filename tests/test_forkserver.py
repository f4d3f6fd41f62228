"""The fork server (retrain_local/forkserver.py): a script forked from the warm interpreter is what
``python script`` is -- output, exit code, arguments, folder, environment, and a rank's training --
and none of its children outlives its caller, its pod's kill or the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from training_support import REPO, child_env, nemo_args, pattern_bucket, standin_env

from retrain.tensorboard import read_scalars
from retrain_local.forkserver import Child, ForkServer
from retrain_local.images import local_images
from retrain_local.processes import free_port
from retrain_local.torchrun import rank_fork_server
from retrain_ops.deployment import NEMO_STANDIN

pytestmark = pytest.mark.integration

SCRIPT = """\
import os, sys
print("argv", sys.argv, "file", __file__, "cwd", os.getcwd(), "path0", sys.path[0])
print("env", sorted(k for k in os.environ if k.startswith("T_")), os.environ.get("T_VALUE"))
print("fds", sorted(int(fd) for fd in os.listdir("/proc/self/fd")))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "exit":
    sys.exit(int(sys.argv[2]))
if how == "message":
    sys.exit("a message for stderr")
if how == "raise":
    raise ValueError("raised at the top")
if how == "signal":
    sys.stdout.flush()
    os.kill(os.getpid(), 9)
if how == "threads":  # left running at the end: a pool never shut down, a thread, an exit handler
    import atexit, concurrent.futures, threading, time
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="bpe")
    print("pooled", pool.submit(sum, [1, 2]).result())
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended", flush=True))).start()
    atexit.register(lambda: print("exit handler ran"))
"""


def alive(pid: int) -> bool:
    """Running (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    log = tmp_path_factory.mktemp("fork") / "server.log"
    fs = ForkServer(("json", "email.parser"), log).start()
    yield fs
    fs.stop()
    assert not fs.socket_path.parent.exists()  # its private folder goes with it


def forked(
    server: ForkServer, argv: list[str], env: dict[str, str], cwd: Path, out: Path
) -> tuple[int, str, str]:
    """Run through the server with stdout and stderr to files, as a pod's launcher runs it."""
    with open(out / "out", "wb") as o, open(out / "err", "wb") as e:
        saved = os.dup(1), os.dup(2)
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            child = Child(server.socket_path, argv, env, str(cwd))
        finally:
            for fd, saved_fd in zip((1, 2), saved, strict=True):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
        code = child.wait()
    return code, (out / "out").read_text(), (out / "err").read_text()


@pytest.mark.parametrize(
    "how",
    [["exit", "0"], ["exit", "3"], ["exit", "300"], ["message"], ["raise"], ["signal"], ["threads"], ["end"]],
)
def test_a_forked_script_is_what_python_runs(server: ForkServer, tmp_path: Path, how: list[str]) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    cwd = tmp_path / "work"
    cwd.mkdir()
    env = {"PATH": os.environ["PATH"], "T_VALUE": "given", "T_OTHER": "x"}
    named = "../s.py"  # relative to the folder, as a command may name it
    fresh = subprocess.run([sys.executable, named, *how], env=env, cwd=cwd, capture_output=True, text=True)
    (tmp_path / "f").mkdir()
    code, out, err = forked(server, [named, *how], env, cwd, tmp_path / "f")
    assert (code, out, err) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert f"file {cwd}/../s.py cwd {cwd} path0 {tmp_path}" in out
    assert "env ['T_OTHER', 'T_VALUE'] given" in out and "fds [0, 1, 2, 3]" in out


def test_a_child_starts_with_the_preload_imported(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    # colorsys: a module nothing here imports (tomllib was one until coverage's own start-up in every child
    # under ./scripts/coverage imported it to read pyproject.toml)
    script.write_text(
        "import sys\nprint(sorted(m for m in ('json', 'email.parser', 'colorsys') if m in sys.modules))\n"
    )
    code, out, _ = forked(server, [str(script)], {}, tmp_path, tmp_path)
    assert (code, out) == (0, "['email.parser', 'json']\n")


@pytest.mark.parametrize(
    "request_line",
    [b"not json\n", b'{"run": []}\n', b'{"run": "s.py"}\n', b'{"kill": 3}\n', b"{}\n", b"[1]\n"],
)
def test_a_request_it_cannot_serve_is_refused_and_the_server_serves_on(
    server: ForkServer, tmp_path: Path, request_line: bytes
) -> None:
    Child(server.socket_path, [str(tmp_path / "absent.py")], {}).wait()  # serving (it binds once preloaded)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(server.socket_path))
        sock.sendall(request_line)
        answer = json.loads(sock.makefile("rb").readline())
    assert list(answer) == ["error"] and answer["error"]
    script = tmp_path / "s.py"
    script.write_text("print('served')\n")
    assert forked(server, [str(script)], {}, tmp_path, tmp_path)[:2] == (0, "served\n")


def test_a_pods_kill_kills_its_children_and_no_other(server: ForkServer, tmp_path: Path) -> None:
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(120)\n")
    mark = "RETRAIN_TWIN_POD"
    a1, a2 = (Child(server.socket_path, [str(sleeper)], {mark: "pod-a"}) for _ in range(2))
    b = Child(server.socket_path, [str(sleeper)], {mark: "pod-b"})
    assert sorted(server.kill(mark, "pod-a")) == sorted([a1.pid, a2.pid])
    assert not alive(a1.pid) and not alive(a2.pid)  # gone when kill returns
    assert (a1.wait(), a2.wait()) == (-signal.SIGKILL, -signal.SIGKILL)
    assert alive(b.pid) and server.kill(mark, "pod-a") == []
    assert server.kill(mark, "pod-b") == [b.pid] and b.wait() == -signal.SIGKILL


def test_a_caller_that_goes_takes_its_child_along(server: ForkServer, tmp_path: Path) -> None:
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(120)\n")
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from retrain_local.forkserver import Child\n"
            f"c = Child(Path({str(server.socket_path)!r}), [{str(sleeper)!r}], {{}})\n"
            "print(c.pid, flush=True); c.wait()",
        ],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    assert caller.stdout is not None
    pid = int(caller.stdout.readline())
    assert alive(pid)
    caller.kill()
    caller.wait()
    assert gone_within(pid)


def test_the_servers_own_environment_is_set_before_it_imports_its_preload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a library reads as it loads (OpenMP's wait policy, read as PyTorch loads libgomp) is in the
    server's environment when it imports its preload, beside the environment it was started from: its
    children are forked with that library loaded."""
    monkeypatch.setenv("FROM_THE_PARENT", "kept")
    (tmp_path / "reads_at_load.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['SEEN_AT']).write_text("
        "os.environ.get('AT_LOAD', '-') + ' ' + os.environ.get('FROM_THE_PARENT', '-'))\n"
    )
    seen = tmp_path / "seen"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {"AT_LOAD": "set", "SEEN_AT": str(seen), "PYTHONPATH": path}
    fs = ForkServer(("reads_at_load",), tmp_path / "server.log", env=env).start()
    try:
        deadline = time.monotonic() + 60
        while not seen.exists():
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.05)
        assert seen.read_text() == "set kept"
    finally:
        fs.stop()


def test_children_die_with_the_server(tmp_path: Path) -> None:
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(120)\n")
    fs = ForkServer((), tmp_path / "server.log").start()
    child = Child(fs.socket_path, [str(sleeper)], {})
    assert fs.proc is not None
    fs.proc.kill()  # not its stop: a server that crashed
    fs.proc.wait()
    assert gone_within(child.pid)
    fs.stop()


def launcher(fs: ForkServer | None, workdir: Path) -> list[str]:
    """The stand-in image's ``torchrun`` (the shim the cluster twin's images put on a pod's PATH), forking
    its ranks from ``fs`` when given."""
    images = local_images(workdir, standin_launcher=True, fork_server=fs.socket_path if fs else None)
    return [str(Path(images[NEMO_STANDIN].path[0]) / "torchrun")]


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "forked"])
def test_the_stand_in_launcher_starts_ranks_as_torchrun_does(tmp_path: Path, warm: bool) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys; from pathlib import Path\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_PORT')\n"
        "Path(sys.argv[1], os.environ['RANK']).write_text(' '.join(os.environ[k] for k in keys))\n"
        "sys.exit(int(os.environ['RANK']) == 3 and 7)\n"
    )
    fs = ForkServer((), tmp_path / "server.log").start() if warm else None
    argv = [*launcher(fs, tmp_path), "--nnodes=2", "--nproc-per-node=2"]
    argv += ["--node-rank=1", "--master-addr=127.0.0.1", "--master-port=1234", str(script), str(tmp_path)]
    try:
        assert subprocess.run(argv, cwd=REPO, env=child_env(), timeout=60).returncode == 7  # rank 3's
    finally:
        if fs:
            fs.stop()
    assert (tmp_path / "2").read_text() == "2 0 4 2 1 1234"
    assert (tmp_path / "3").read_text() == "3 1 4 2 1 1234"


def test_ranks_forked_from_a_warm_torch_train_exactly_as_fresh_ones(tmp_path: Path) -> None:
    """Two ranks of the NeMo stand-in, through the stand-in launcher with and without the server: the
    same scalars to the last bit (losses, validation loss, learning rate, samples), the same checkpoints."""
    pytest.importorskip("torch", reason="PyTorch is not installed: the stand-in trains with it")
    fs = rank_fork_server(tmp_path / "server.log").start()  # the stack's (retrain_local.in_cluster)
    assert fs.proc is not None
    ran: dict[bool, tuple[list[tuple[str, int, float]], list[str]]] = {}
    try:
        for warm in (False, True):
            mount = pattern_bucket(tmp_path / f"warm-{warm}")
            argv = [
                *launcher(fs if warm else None, tmp_path / f"bin-{warm}"),
                "--nnodes=1",
                "--nproc-per-node=2",
            ]
            argv += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
            argv += [str(REPO / "retrain_local" / "train" / "standin.py")]
            argv += nemo_args(mount, [1.0, "gs://b/shards/p/data_text_document"], gpus=2, steps=8, run_id="r")
            r = subprocess.run(argv, cwd=REPO, env=standin_env(), capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            run = mount / "b" / "runs" / "r" / "megatron_gpt"
            (events,) = run.glob("events.out.tfevents.*")
            scalars = [(s.tag, s.step, s.value) for s in read_scalars(events.read_bytes())]
            ran[warm] = (scalars, sorted(p.name for p in (run / "checkpoints").iterdir()))
        # OpenMP reads its wait policy as PyTorch loads it: in the server's own environment, from its start.
        # (Read once it has served: Popen returns before the kernel has finished the exec, and until then
        # /proc/PID/environ reads empty, as it once did in a full run.)
        environ = Path(f"/proc/{fs.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_WAIT_POLICY=PASSIVE" in environ, environ
    finally:
        fs.stop()
    tags = {tag for tag, _, _ in ran[False][0]}
    assert {"reduced_train_loss", "val_loss", "lr"} <= tags and ran[True] == ran[False], ran
