"""Ray for `python -m higgs_onnx.corpus` and `serve --ray`: `check_address` (a `--address` checked before Ray
starts: its form, Ray Client for ray://, and a TCP answer within CONNECT_S), and a local instance's processes: its
own temporary folder (short enough for Ray's socket paths), the processes still using one after a run (found and
stopped, SIGTERM then SIGKILL), and SIGTERM taken like Ctrl-C while a run goes on."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import time

log = logging.getLogger("higgs_onnx.corpus")
RAY_TEMP_PREFIX = "higgs-ray-"
# Ray puts its unix sockets at <temp>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store (~65 bytes after
# <temp>), and a socket path has at most 107 bytes: a longer $TMPDIR falls back to /tmp.
MAX_RAY_TEMP_BASE = 32
CONNECT_S = 10.0  # a cluster address that does not answer a TCP connection within this is refused


class StopSignal:
    """SIGTERM handled like Ctrl-C (a KeyboardInterrupt), so `ray.shutdown()` runs and stops the local instance.

    `install` before and again after `ray.init`, which sets SIGTERM handlers of its own (a SIGTERM while it runs is
    Ray's SystemExit(15), which the same `finally` handles). Ctrl-C is raised by the same handler, so its signal is
    recorded: one that lands in an at-fork hook while Ray starts its processes is swallowed there ("Exception
    ignored in _resume_parent_after_fork"; that line and its traceback are not printed, since the signal is not
    lost), and `check` raises it again afterwards. `shield` while shutting down: a
    second signal is noted, not raised, so the shutdown is not cut short. `signum` says which signal stopped the job."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._unraisable = None

    def _swallowed(self, unraisable) -> None:
        """sys.unraisablehook: our own KeyboardInterrupt, swallowed where Python cannot raise it, is kept quiet
        (`check` raises it again); anything else goes to the hook that was there."""
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and self.signum is not None):
            (self._unraisable or sys.__unraisablehook__)(unraisable)

    @staticmethod
    def _main_thread() -> bool:  # signals reach the main thread only; run() in a thread leaves them alone
        return threading.current_thread() is threading.main_thread()

    def _raise(self, signum, frame):
        self.signum = signum
        raise KeyboardInterrupt

    def _note(self, signum, frame):
        self.signum = self.signum or signum

    def install(self) -> None:
        if self._main_thread():
            if self._unraisable is None:
                self._unraisable, sys.unraisablehook = sys.unraisablehook, self._swallowed
            self._previous.setdefault(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
            signal.signal(signal.SIGTERM, self._raise)
            self._previous.setdefault(signal.SIGINT, signal.getsignal(signal.SIGINT))
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored Ctrl-C stays ignored
                signal.signal(signal.SIGINT, self._raise)

    def check(self) -> None:
        """Raise a signal whose KeyboardInterrupt was swallowed (see the class docstring)."""
        if self.signum is not None:
            raise KeyboardInterrupt

    def shield(self) -> None:
        if self._main_thread():
            for sig in self.SIGNALS:
                self._previous.setdefault(sig, signal.getsignal(sig))
                if signal.getsignal(sig) is not signal.SIG_IGN:  # an ignored Ctrl-C (nohup, `&`) stays ignored
                    signal.signal(sig, self._note)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._unraisable is not None:
            sys.unraisablehook, self._unraisable = self._unraisable, None


def ray_temp_dir() -> str:
    """A private, short folder for a local Ray instance's session files (see the module docstring)."""
    base = tempfile.gettempdir()
    if len(base) > MAX_RAY_TEMP_BASE:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=RAY_TEMP_PREFIX, dir=base)


def processes_using(folder: str) -> list[int]:
    """Pids of processes (other than this one) that name `folder` in their command line, run in it or have a file
    open in it (Linux /proc; elsewhere none)."""
    if not os.path.isdir("/proc"):
        return []
    folder = os.path.realpath(folder)
    inside, pids = folder.rstrip("/") + "/", []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if folder.encode() in f.read():
                    pids.append(int(name))
                    continue
            links = [os.readlink(f"/proc/{name}/cwd")]
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/{name}/fd/{fd}"))
            except OSError:  # this file was closed meanwhile: the process is still scanned
                continue
        if any(link == folder or link.startswith(inside) for link in links):
            pids.append(int(name))
    return pids


def stop_leftovers(folder: str, grace_s: float = 3.0, rounds: int = 4) -> list[int]:
    """Stop what is left of a local instance after `ray.shutdown()`: processes it did not know yet (a signal during
    `ray.init`) or orphaned agents, found through its private `folder`. SIGTERM, then SIGKILL after `grace_s`;
    scanned again until nothing is left (a dying raylet may just have started a worker). Returns the pids found."""
    found: list[int] = []
    for _ in range(rounds):
        pids = [p for p in processes_using(folder) if _alive(p)]
        if not pids:
            break
        log.info("stopping %d Ray process(es) left after ray.shutdown: %s", len(pids), pids)
        found += pids
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for p in pids if _alive(p)]
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0  # SIGKILL is not instant: let them go before looking again
        while pids and time.monotonic() < deadline:
            time.sleep(0.02)
            pids = [p for p in pids if _alive(p)]
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # gone meanwhile
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie is gone for our purposes
    except OSError:
        return False


def check_address(address: str | None) -> None:
    """A `ray://` address needs Ray Client (grpcio): pinned here, but a hand-made install may lack it."""
    import importlib.metadata
    import importlib.util

    if address is None:
        return
    if not address.strip():
        raise ValueError("--address is empty: give 'auto', HEAD:6379 or ray://HEAD:10001, or leave it out to start "
                         "a local instance")
    if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
        try:
            version = importlib.metadata.version("ray")
        except importlib.metadata.PackageNotFoundError:
            version = "2.60.0"
        raise ValueError(f"--address {address} needs Ray Client, which is not installed: pip install "
                         f"\"ray[client]=={version}\" (or join the cluster with --address auto / HEAD:6379 from a "
                         f"node of it)")
    check_reachable(address)


def check_reachable(address: str) -> None:
    """A HEAD:PORT or ray://HEAD:PORT address must answer a TCP connection within CONNECT_S: Ray itself would retry
    a GCS address for ever, and Ray Client tries for about 30 s before its one line. `auto` finds a local cluster's
    address on its own (and fails fast)."""
    import socket

    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit() or "/" in host:
        raise ValueError(f"--address {address!r}: give HEAD:PORT (the head's GCS port, 6379 by default), 'auto' or "
                         f"ray://HEAD:10001")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=CONNECT_S).close()
    except OSError as e:
        raise ValueError(f"--address {address}: no Ray cluster answers there ({e.strerror or e}); start one with "
                         f"`ray start --head` or leave --address out for a local one") from None
