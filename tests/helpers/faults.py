"""Launch a training command so that the TEST chooses where it is killed, not a timer.

A kill chosen by timing (polling a folder every few ms, watching log lines) lands somewhere else when the
machine is loaded.  Here each rank stops itself at a named point and waits there; the test SIGKILLs the
whole launch only once every rank has arrived, so the state on disk at the kill is always the same.

Rank side: the training command runs under this file, e.g. ``python tests/helpers/faults.py -m distill RECIPE``
or ``accelerate launch ... tests/helpers/faults.py tests/helpers/zero3_run.py RECIPE``.  Each rank then

- writes its stdout and stderr to ``rank<R>.out`` / ``rank<R>.err`` in ``$FAULT_DIR`` (R = global rank:
  never two ranks in one pipe), and its pid to ``pid.<R>``;
- with ``$FAULT_AT`` set, patches the library from here (the library holds no test hooks) so that at that
  point it writes ``reached.<R>`` and blocks until it is killed.  The points:

  ``checkpoint:N``  inside step N's checkpoint write: this rank's ``accelerator.save_state`` has written its
                    files into ``checkpoints/.step_N.tmp``; no ``trainer_state.json`` yet, no rename
  ``step:N``        step N's optimizer step is done, its scheduler step is not: nothing of step N is logged
                    or saved (step N-1's log record, checkpoint and running checkpoint are complete)

  Either point may name the run it applies to, ``checkpoint:N@NAME``: only a run whose ``output_dir`` is
  called NAME stops there (a sweep trains several runs in one process: ``@l3`` picks its candidate l = 3).

Test side: :class:`Job` starts one launch (one process, ``torch.distributed.run`` or ``accelerate launch``) in
a session of its own, on a rendezvous port held by the test for the whole launch (:func:`reserve_port`: no
port probed with bind(0), closed and reused, and never accelerate's default 29500)::

    with Job(tmp_path, ["-m", "distill", recipe], processes=2, config="cpu_2proc_zero3", at="checkpoint:4") as job:
        job.kill_at_point()          # every rank is inside step 4's checkpoint write: SIGKILL them all
    with Job(tmp_path, ["-m", "distill", recipe], processes=2, config="cpu_2proc_zero3") as job:
        job.finish()                 # exit status 0, else a failure showing every rank's stderr
        assert "resumed from" in job.output()

Several launches that form one job (two "nodes" on this machine) share a port: pass the same
``reserve_port()`` socket as ``port=`` and the node's launcher options as ``launcher_args``, and give each
``Job`` its global ``ranks``.  Leaving the ``with`` block SIGKILLs whatever is left of the launch: the
launcher's process group and every rank's (torch's launcher starts each rank in a session of its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = (
    Path(__file__).resolve().parents[2]
)  # the checkout (this file also runs as a script: no helpers import)
WRAPPER = Path(__file__).resolve()
PY = sys.executable
POINTS = ("checkpoint", "step")


# ---------------------------------------------------------------------------------------------- rank side


def _reach(folder: Path, rank: int, at: str) -> None:
    """Record that this rank is at the point, then wait for the test's SIGKILL."""
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = folder / f".reached.{rank}"
    tmp.write_text(json.dumps({"at": at, "pid": os.getpid()}))
    os.replace(tmp, folder / f"reached.{rank}")
    while True:
        signal.pause()


def install(at: str, folder: Path, rank: int) -> None:
    """Patch the training code (from here, not in the library) to stop at ``at``."""
    point, _, run_name = at.partition("@")
    name, _, n = point.partition(":")
    if name not in POINTS or not n.isdigit():
        raise SystemExit(f"faults.py: unknown point {at!r} (expected one of {POINTS} as NAME:STEP[@RUN])")
    target = int(n)

    def here(run) -> bool:  # the point's run: any, or the one whose output_dir is named run_name
        return not run_name or run.out.name == run_name

    import torch
    from accelerate import Accelerator

    import distill.train as train

    if name == "checkpoint":
        real_checkpoint, real_save_state = train.save_checkpoint, Accelerator.save_state
        writing: list[int] = []

        def save_checkpoint(run, step: int) -> None:
            writing.append(step if here(run) else None)
            try:
                real_checkpoint(run, step)
            finally:
                writing.pop()

        def save_state(self, *args, **kwargs):
            out = real_save_state(self, *args, **kwargs)
            if writing and writing[-1] == target:
                _reach(folder, rank, at)
            return out

        train.save_checkpoint, Accelerator.save_state = save_checkpoint, save_state
    else:
        real_loop = train.loop
        real_step = torch.optim.lr_scheduler.LambdaLR.step
        watched: dict[int, int] = {}  # id(the run's scheduler) -> the step its next call completes

        def loop(run, *args, **kwargs):
            if here(run):
                watched[id(run.scheduler)] = run.start_step + 1
            return real_loop(run, *args, **kwargs)

        def step(self, *args, **kwargs):  # on the class: the scheduler's own state_dict stays untouched
            if id(self) in watched:
                if watched[id(self)] == target:
                    _reach(folder, rank, at)
                watched[id(self)] += 1
            return real_step(self, *args, **kwargs)

        train.loop, torch.optim.lr_scheduler.LambdaLR.step = loop, step


def _die_with_parent() -> None:
    """SIGKILL this rank when its launcher dies (a launcher killed first must not leave a rank running)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher died before the line above
        os._exit(1)


def main(argv: list[str]) -> None:
    folder, rank = Path(os.environ["FAULT_DIR"]), int(os.environ.get("RANK", "0"))
    _die_with_parent()
    for fd, suffix in ((1, "out"), (2, "err")):
        with open(folder / f"rank{rank}.{suffix}", "ab") as f:
            os.dup2(f.fileno(), fd)
    sys.stdout.reconfigure(line_buffering=True)
    (folder / f"pid.{rank}").write_text(str(os.getpid()))
    sys.path.insert(0, str(ROOT))  # this checkout's packages, whatever is installed
    if os.environ.get("FAULT_AT"):
        install(os.environ["FAULT_AT"], folder, rank)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------------------------------------- test side


def reserve_port() -> socket.socket:
    """A free 127.0.0.1 port, held for as long as the returned socket is open: it is bound with SO_REUSEADDR
    and not listening, so no other bind on this machine gets it, while a rendezvous store that binds it
    with SO_REUSEADDR (torch's TCPStore does) can listen on it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def env(extra: dict | None = None) -> dict:
    """The environment of every launched training process: offline, one thread, unbuffered."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


def _groups_below(root: int) -> set[int]:
    """The process groups of ``root`` and of all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    groups, todo = set(), [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
        todo += children.get(pid, [])
    return groups


class Job:
    """One launch of ``target`` (``["-m", "module", args...]`` or ``[script, args...]``) under this wrapper.

    ``processes`` ranks: one plain process; more through ``torch.distributed.run`` (DDP); with ``config``
    (a name in recipes/accelerate/) through ``accelerate launch --config_file`` with ``--num_processes``.
    ``at`` is the fault point (see the module docstring).  Output of every rank and of the launcher is kept
    in files under a fresh folder in ``parent``; ``output()`` joins them."""

    def __init__(
        self,
        parent: Path,
        target: Sequence[str],
        processes: int = 1,
        config: str | None = None,
        at: str | None = None,
        *,
        launcher_args: Sequence[str] = (),
        ranks: Sequence[int] | None = None,
        port: socket.socket | None = None,
        extra_env: dict | None = None,
    ) -> None:
        Path(parent).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="launch-", dir=parent))
        self.ranks = list(range(processes) if ranks is None else ranks)
        self._own_port = port is None
        self.port = reserve_port() if port is None else port
        number = str(self.port.getsockname()[1])
        wrapped = [str(WRAPPER), *map(str, target)]
        if config is not None:
            self.cmd = [PY, "-m", "accelerate.commands.launch", "--config_file"]
            self.cmd += [f"recipes/accelerate/{config}.yaml", "--num_processes", str(processes)]
            self.cmd += ["--main_process_port", number, *launcher_args, *wrapped]
        elif processes > 1 or launcher_args:
            self.cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node"]
            self.cmd += [str(processes), "--master-addr", "127.0.0.1", "--master-port", number]
            self.cmd += [*launcher_args, *wrapped]
        else:
            self.cmd = [PY, *wrapped]
        self.env = env(
            {"FAULT_DIR": str(self.folder), **({"FAULT_AT": at} if at else {}), **(extra_env or {})}
        )
        self.proc: subprocess.Popen | None = None

    @classmethod
    def command(cls, parent: Path, cmd: Sequence[str], port: socket.socket) -> Job:
        """Any command line (a launch script that holds ``port``), run as a Job: a session of its own, its
        output in files, everything it started SIGKILLed when the ``with`` block ends."""
        job = cls(parent, [], ranks=[], port=port)
        job.cmd = [str(c) for c in cmd]
        return job

    def __enter__(self) -> Job:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
        if self._own_port:
            self.port.close()

    def start(self) -> Job:
        with open(self.folder / "launcher.out", "wb") as out, open(self.folder / "launcher.err", "wb") as err:
            self.proc = subprocess.Popen(
                self.cmd, cwd=ROOT, env=self.env, stdout=out, stderr=err, start_new_session=True
            )
        return self

    def output(self, rank: int | None = None, stream: str = "") -> str:
        """``rank``'s stdout and stderr (``stream`` "out" or "err": only that one); by default the
        launcher's and every rank's, one after the other."""
        names = [f"rank{rank}"] if rank is not None else ["launcher"] + [f"rank{r}" for r in self.ranks]
        streams = [stream] if stream else ["out", "err"]
        files = [self.folder / f"{n}.{s}" for n in names for s in streams]
        return "".join(f.read_text(errors="replace") for f in files if f.is_file())

    def _fail(self, why: str):
        import pytest

        self.kill()
        tails = "\n".join(
            f"--- {p.name}:\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.folder.glob("*.err"))
        )
        pytest.fail(f"{' '.join(self.cmd)}: {why}\n{tails}", pytrace=False)

    def finish(self, expect: int = 0, timeout: float = 900) -> Job:
        """Wait for the launch to end; fail (showing every rank's stderr) unless its status is ``expect``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._fail(f"still running after {timeout:.0f} s")
        if code != expect:
            self._fail(f"exit status {code}, expected {expect}")
        return self

    def wait_reached(self, timeout: float = 900) -> None:
        """Return once every rank has written ``reached``; fail if the launch ends first or the time runs out.
        (Polling is safe here: the ranks wait at the point, so when this sees them does not matter.)"""
        deadline = time.monotonic() + timeout
        while not all((self.folder / f"reached.{r}").is_file() for r in self.ranks):
            if self.proc.poll() is not None:
                self._fail(f"ended (status {self.proc.returncode}) before every rank reached the point")
            if time.monotonic() > deadline:
                self._fail(f"not every rank reached the point within {timeout:.0f} s")
            time.sleep(0.05)

    def kill_at_point(self, timeout: float = 900) -> Job:
        """Wait until every rank is at the fault point, then SIGKILL the whole launch."""
        self.wait_reached(timeout)
        self.kill()
        return self

    def kill(self) -> None:
        """SIGKILL the launcher's process group, every rank's and those of anything they started."""
        if self.proc is None:
            return
        groups = _groups_below(self.proc.pid) | {self.proc.pid}
        for pid_file in self.folder.glob("pid.*"):  # ranks whose launcher has already gone
            with contextlib.suppress(ValueError, OSError):
                pid = int(pid_file.read_text())
                if f"FAULT_DIR={self.folder}\0".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    groups.add(os.getpgid(pid))  # still this launch's rank, not a reused pid
        for group in groups - {os.getpgid(0)}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        self.proc.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
