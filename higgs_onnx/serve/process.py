"""The speech server in a child process (`python -m higgs_onnx.serve` on a free port): for the tests, the
benchmarks and any script that wants a real server beside it. `url` once the server printed its ready line."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """Start the server for `model` with its saved voices in `voices`, its log (stderr) in `log`, and the extra
    command-line `args`; raises RuntimeError with the log's tail when it exits or is not ready within `timeout`.
    `python` and `cwd`: another interpreter (an installed package's venv) and where it starts."""

    def __init__(self, model: str | os.PathLike, voices: str | os.PathLike, log: str | os.PathLike, *args: str,
                 timeout: float = 120.0, python: str | os.PathLike = sys.executable, cwd: str | os.PathLike = REPO,
                 env: dict[str, str] | None = None):
        self.log = Path(log)
        cmd = [str(python), "-m", "higgs_onnx.serve", "--model-path", str(model), "--port", "0",
               "--voices", str(voices), *args]
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True,
                                     env={**(os.environ if env is None else env), "CI": "1"})
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the server did not start:\n{self.log.read_text()[-2000:]}") from None
                continue
            if m := re.search(r"http://[^/\s]+", line):
                self.url, self.banner = m.group(0), line.strip()
                return

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL after `timeout` s."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
