"""A warm interpreter that starts Python scripts by forking, so that what a script imports is paid once.

A stand-in rank's first 2.5 s of CPU, over half of it, is ``import torch``, and the local stack starts a
rank for every pod of every attempt.  The fork server imports the heavy modules once (``preload``), then
forks a child for each script it is asked to run: the child takes the caller's argv, environment, working
folder and output, runs the script as ``__main__`` and exits with the code
``python script`` would have.  Forking after ``import torch`` and before any of its work is what
PyTorch's own DataLoader workers do.

The caller (a :class:`Child`: the stand-in ``torchrun`` makes one a rank) keeps its connection open
while the child runs and is told its exit code, so it waits on the child as on a process of its own.
A caller that goes takes its child along (the server kills the child when the connection closes);
:meth:`ForkServer.kill` kills, and reaps, every child started with an environment variable's value (the
cluster twin's pod mark: a forked child's ``/proc/<pid>/environ`` shows the server's environment, not
the one it was given); a child dies with the server (``PR_SET_PDEATHSIG``).  The socket sits in a
folder only this user may enter: whoever connects runs code as this user.

Protocol, over a Unix socket, one request per connection: the caller sends one JSON line with its
standard output and error as file descriptors (``SCM_RIGHTS``): ``{"run": [script, *args], "env": {...},
"cwd": "..."}``; the server answers ``{"pid": N}`` once forked and ``{"exit": code}`` when the child ended
(a negative code: killed by that signal, as :attr:`subprocess.Popen.returncode`).  ``{"kill": [name,
value]}`` answers ``{"killed": [pids]}`` once they are gone.

``python -m retrain_local.forkserver --run SOCKET SCRIPT ARGS...`` (:func:`run_forked`) is such a caller
as a process: a server started as a process of its own (a function of the local stack, supervised,
stopped and restarted as any) is forked instead, and the caller stands for it.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import ctypes
import importlib
import importlib.machinery
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain_local import processes

#: How long a caller waits for the server to accept (its preload: PyTorch's import on a loaded machine).
CONNECT_TIMEOUT_S = 120.0
#: The longest request line (a pod's environment is a few kB).
MAX_REQUEST = 1 << 20
_PR_SET_PDEATHSIG = 1


class ForkServerError(RuntimeError):
    """The fork server could not be reached or refused a request."""


@dataclass
class _Forked:
    """A child the server forked, and the caller's connection it answers on."""

    pid: int
    conn: socket.socket
    env: dict[str, str]


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # a caller that went is told nothing
        conn.sendall(json.dumps(message).encode() + b"\n")


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One JSON object on a line, and the descriptors sent with it (closed here if the request is bad)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST, 2)
    try:
        while not data.endswith(b"\n"):
            more = conn.recv(MAX_REQUEST)
            if not more or len(data) > MAX_REQUEST:
                raise ForkServerError("incomplete request")
            data += more
        request = json.loads(data)
        if not isinstance(request, dict):
            raise ForkServerError(f"not a request: {data[:80]!r}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


class _Server:
    """The server's loop: one thread (forking beside other threads is what fork is not safe for), woken by
    new callers, callers' hang-ups and SIGCHLD."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.listener.bind(str(path))
        self.listener.listen(64)
        self.children: dict[int, _Forked] = {}
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears it
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "signal")

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    with contextlib.suppress(BlockingIOError):
                        self.wake_r.recv(4096)
                else:
                    self._hung_up(key.data)
            self._reap()

    def _accept(self) -> None:
        """One caller's request; a request it cannot serve is answered with an error, and the server
        goes on serving the others."""
        conn, _ = self.listener.accept()
        conn.settimeout(10.0)  # a caller sends its request at once
        fds: list[int] = []
        try:
            request, fds = _read_request(conn)
            if "kill" in request:
                name, value = (str(v) for v in request["kill"])
                _send(conn, {"killed": self._kill_marked(name, value)})
                conn.close()
                return
            argv, env = request.get("run"), request.get("env") or {}
            if not argv or not isinstance(argv, list) or not isinstance(env, dict):
                raise ForkServerError(f"neither a run nor a kill: {sorted(request)}")
            argv = [str(a) for a in argv]
            env = {str(k): str(v) for k, v in env.items()}
            pid = self._fork(argv, env, str(request.get("cwd") or os.getcwd()), fds, conn)
        except (OSError, ValueError, TypeError, ForkServerError) as e:  # fork failed too (no memory)
            _send(conn, {"error": f"{type(e).__name__}: {e}"})
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.children[pid] = _Forked(pid, conn, env)
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, pid)
        _send(conn, {"pid": pid})

    def _fork(
        self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int], conn: socket.socket
    ) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid:
            return pid
        try:  # the child: never returns into the server's loop
            code = self._become(argv, env, cwd, fds, server, conn)
        except BaseException:
            traceback.print_exc()
            code = 1
        _exit(code)
        raise AssertionError("unreachable")

    def _become(
        self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int], server: int, conn: socket.socket
    ) -> int:
        """The child: a fresh process's state as ``python script args`` in ``cwd`` with ``env`` would
        have it, then the script."""
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:  # the server went before the prctl
            return 1
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        for s in (self.listener, self.wake_r, self.wake_w, conn, *(c.conn for c in self.children.values())):
            s.close()
        out = fds[0] if fds else os.open(os.devnull, os.O_WRONLY)
        err = fds[1] if len(fds) > 1 else out
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err} - {0, 1, 2}:  # a fresh process holds its three standard streams only
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        # as `python script` names it: argv[0] as given, __file__ joined to the folder, and the script's
        # real folder first on sys.path
        script = os.path.join(os.getcwd(), argv[0])
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        try:
            _run_main(script)
        except SystemExit as e:
            return _exit_code(e.code)
        except BaseException as e:
            tb = e.__traceback__  # from the script's frame on, as `python script` prints it
            while tb is not None and tb.tb_frame.f_code.co_filename != script:
                tb = tb.tb_next
            if tb is not None:
                e = e.with_traceback(tb)
            sys.excepthook(type(e), e, e.__traceback__)
            return 1
        return 0

    def _hung_up(self, pid: int) -> None:
        """A caller's connection became readable: it went (or sent what it may not); its child goes."""
        child = self.children.get(pid)
        if child is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            if child.conn.recv(1):
                return  # a caller has nothing more to say; ignore it
        self.selector.unregister(child.conn)
        _kill(pid)

    def _kill_marked(self, name: str, value: str) -> list[int]:
        marked = [c.pid for c in self.children.values() if c.env.get(name) == value]
        for pid in marked:
            _kill(pid)
        for pid in marked:
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(pid, 0)
                self._ended(pid, status)
        return marked

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._ended(pid, status)

    def _ended(self, pid: int, status: int) -> None:
        child = self.children.pop(pid, None)
        if child is None:
            return
        _send(child.conn, {"exit": _returncode(status)})
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(child.conn)
        child.conn.close()

    def stop(self) -> None:
        for pid in list(self.children):
            _kill(pid)


def _kill(pid: int) -> None:
    """SIGKILL a child and its session's group (a child forked a moment ago may not lead one yet)."""
    for kill in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)


def _run_main(script: str) -> None:
    """Run ``script`` as the interpreter runs its main script: a fresh ``__main__`` with its ``__file__``
    and a source loader (:func:`runpy.run_path` would set ``sys.argv[0]`` to the path it is given)."""
    with io.open_code(script) as f:
        code = compile(f.read(), script, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=script,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", script),
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _returncode(status: int) -> int:
    """What :attr:`subprocess.Popen.returncode` says of a wait status."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _exit_code(code: object) -> int:
    """The exit status ``SystemExit(code)`` gives a Python process (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """End the child as an interpreter ends (``Py_FinalizeEx``): threading's shutdown, which first runs
    the callbacks registered for it (``concurrent.futures`` wakes its idle pool workers so that they end)
    and then joins every other non-daemon thread; then the exit handlers; then the output flushed.
    Joining first, as this did, waited forever on a pool the script left open (a tokenize job's)."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls at exit
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def _connect(path: Path, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            if time.monotonic() > deadline:
                raise ForkServerError(f"no fork server answers at {path} after {timeout_s:.0f}s: {e}") from e
            time.sleep(0.05)


def _request(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    socket.send_fds(sock, [json.dumps(message).encode() + b"\n"], fds)


class Child:
    """A script the server forked for this process: waited on as a :class:`subprocess.Popen`.  Its
    output goes to this process's (``stdout``, ``stderr``: other descriptors, as Popen's)."""

    def __init__(
        self,
        path: Path,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None = None,
        stdout: int = 1,
        stderr: int = 2,
    ) -> None:
        self.sock = _connect(path, CONNECT_TIMEOUT_S)
        self._answers = self.sock.makefile("rb")
        _request(self.sock, {"run": argv, "env": env, "cwd": cwd or os.getcwd()}, [stdout, stderr])
        self.pid = int(self._answer("pid"))
        self.returncode: int | None = None

    def _answer(self, key: str) -> Any:
        line = self._answers.readline()
        if not line:
            raise ForkServerError(f"the fork server went before answering {key!r}")
        answer = json.loads(line)
        if "error" in answer:
            raise ForkServerError(str(answer["error"]))
        return answer[key]

    def wait(self) -> int:
        """The child's exit code once it ended (negative: the signal that killed it)."""
        if self.returncode is None:
            try:
                self.returncode = int(self._answer("exit"))
            finally:
                self._answers.close()
                self.sock.close()
        return self.returncode


def _private_socket_path() -> Path:
    """A socket in a folder only this user can enter (whoever connects runs code as this user), short
    enough for a Unix socket's 108 bytes wherever the state folder is."""
    return Path(tempfile.mkdtemp(prefix="retrain-fork-")) / "socket"


@dataclass
class ForkServer:
    """The handle of one fork server: started, asked to kill, stopped."""

    preload: tuple[str, ...]
    log_path: Path
    socket_path: Path = field(default_factory=_private_socket_path)
    proc: subprocess.Popen[bytes] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    """Set in the server's own environment before it imports ``preload`` (what a library reads as it
    loads: its children are forked with it loaded)."""

    def start(self) -> ForkServer:
        """Start it and return at once: it accepts once its preload is imported, and callers wait for
        that (:data:`CONNECT_TIMEOUT_S`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.socket_path), *self.preload],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        processes.record(self.proc.pid, f"fork server ({', '.join(self.preload)})")
        return self

    def running(self) -> bool:
        """Whether the server process is still there (it may be starting, or serving)."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self, name: str, value: str) -> list[int]:
        """Kill every child whose environment has ``name`` = ``value``; their pids, once they are gone."""
        if not self.running():
            return []
        try:
            sock = _connect(self.socket_path, 0.0)
        except ForkServerError:  # not serving yet: it has forked nothing
            return []
        with sock, sock.makefile("rb") as answers:
            _request(sock, {"kill": [name, value]}, [])
            line = answers.readline()
        return [int(pid) for pid in json.loads(line).get("killed", [])] if line else []

    def stop(self) -> None:
        """SIGTERM: the server kills its children and exits (they die with it in any case)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.socket_path.parent, ignore_errors=True)


def serve(path: Path, preload: list[str]) -> None:
    """Import ``preload`` (a module that cannot be imported is skipped), then serve at ``path`` until
    SIGTERM."""
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception as e:  # the script that needs it fails on it itself, with its own traceback
            print(f"fork server: not preloaded: {module}: {type(e).__name__}: {e}", flush=True)
    server = _Server(path)

    def stop(*_: object) -> None:
        server.stop()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"fork server: serving at {path} (preloaded {', '.join(preload) or 'nothing'})", flush=True)
    server.serve_forever()


def run_forked(path: Path, argv: list[str]) -> int:
    """This process as ``python script args`` would be, but forked from the server at ``path``: the child
    has this process's environment, folder and output; SIGTERM and SIGINT are passed to the child's whole
    group (a server it started, and that server's workers), and this process ends when the child has,
    with its exit code (128 + the signal that killed it, as a shell reports it).  Killed outright, it
    takes the child along (the server kills a child whose caller went)."""
    child = Child(path, argv, dict(os.environ))

    def forward(sig: int, _: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)  # the child leads its own session (``_become``)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--run"]:  # python -m retrain_local.forkserver --run SOCKET SCRIPT [ARGS...]
        if len(args) < 3:
            raise SystemExit("usage: python -m retrain_local.forkserver --run SOCKET SCRIPT [ARGS...]")
        return run_forked(Path(args[1]), args[2:])
    p = argparse.ArgumentParser(prog="python -m retrain_local.forkserver", description=__doc__)
    p.add_argument("socket", type=Path)
    p.add_argument("preload", nargs="*")
    a = p.parse_args(args)
    serve(a.socket, a.preload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
