"""Child processes that cannot outlive the process that started them, with everything they start.

A vLLM child forks or spawns its EngineCore and worker processes. Left behind by a parent that died (SIGKILL,
an OOM kill, a crash, a signal it did not handle), they keep holding `gpu_memory_utilization` of the GPU until
someone finds them. So every vLLM child is started here:

    parent (`start` / `run`)                         child's process group (its own session)
    holds the write end of a pipe  -- pipe -->       child: calls `watch_parent()` first thing, which forks
                                                     watchdog: blocks reading the pipe; at EOF kills the group
                                                     EngineCore, workers, ...: same group

The kernel closes the parent's end however the parent ends, SIGKILL included, and the read then returns EOF;
the watchdog, a process of its own, answers by SIGKILL to the whole group, itself last. Unlike PR_SET_PDEATHSIG
this covers the grandchildren too and does not depend on which of the parent's threads forked. The parent also
closes its end once the child has exited (`release`, done by `run` and by `Server.stop`), so whatever the child
left in its group goes then too.

The write end is close-on-exec and handed to no other child (Popen closes every fd it was not told to pass); a
process the parent forks without exec would hold it too, and the group would then live as long as that one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import weakref

ENV = "QUANTIZE_PARENT_PIPE"  # the fd number of the pipe's read end, in the child


def start(cmd: list[str], env: dict[str, str], **popen_kw) -> subprocess.Popen:
    """Popen(cmd) in a session and process group of its own, tied to this process by the pipe (module doc)."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(cmd, env={**env, ENV: str(r)}, pass_fds=(r,), start_new_session=True, **popen_kw)
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    proc._parent_pipe = weakref.finalize(proc, os.close, w)  # closed at `release`, or when proc is collected
    return proc


def release(proc: subprocess.Popen) -> None:
    """The child has exited (or is being killed): close this end, so its watchdog clears what is left of its
    group and goes. Calling it twice is harmless."""
    pipe = getattr(proc, "_parent_pipe", None)
    if pipe is not None:
        pipe()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's whole process group (it leads it: its pid is the group's id)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def run(cmd: list[str], env: dict[str, str], timeout: float | None = None, **popen_kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) through `start`; on a timeout (or any exception here,
    Ctrl-C included) the whole group is killed, not only the child, before TimeoutExpired is raised."""
    proc = start(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        proc.communicate()
        raise
    finally:
        release(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def watch_parent() -> None:
    """In a child started by `start`, before it starts any process: fork the watchdog that kills this process
    group when the parent's end of the pipe closes. Without the pipe (started some other way) it does nothing."""
    fd = os.environ.pop(ENV, None)  # popped: the processes this one starts are not the child
    if fd is None:
        return
    fd = int(fd)
    if os.fork() == 0:
        _watchdog(fd)
    os.close(fd)


def _watchdog(fd: int) -> None:
    """The forked watchdog: wait for EOF on the pipe, then SIGKILL the group. It never returns."""
    try:
        # a group-wide SIGTERM or SIGINT (Server.stop's) must not end the watchdog before the group is gone
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        # no stdout / stderr held open: a parent reading the child's output to EOF would wait for the watchdog
        null = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):
            os.dup2(null, std)
        os.closerange(3, fd)
        os.closerange(fd + 1, 1 << 16)
        try:
            while os.read(fd, 1):
                pass  # the parent never writes; EOF (b"") means its end is closed
        except OSError:
            pass  # a pipe that cannot be read can no longer tell that the parent lives: treated as closed
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)
