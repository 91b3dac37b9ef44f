"""Starting the ranks: local processes (:func:`spawn_local`), threads of this process
(:func:`spawn_threads`: ranks that share one GPU) or torchrun (:func:`init_from_env`).

A distributed run must never hang: when one rank dies, its peers block in a collective
or a receive until their timeout. :func:`spawn_local` therefore watches every child from
the parent and, at the first rank that raises, exits non-zero or is killed (or when the
whole run exceeds ``timeout_s``), kills the others and raises :class:`SpawnError` naming
the rank and why. Under torchrun the same role is torchrun's (it tears the job down when a
worker fails); :func:`init_from_env` sets a collective timeout so that a rank waiting on a
dead peer fails instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dflop.errors import InUseError, WriteError

__all__ = [
    "StopRequested",
    "DEFAULT_TIMEOUT_S",
    "ProcessInfo",
    "SpawnError",
    "init_from_env",
    "spawn_local",
    "spawn_threads",
    "start_fork_server",
]

DEFAULT_TIMEOUT_S = 300.0
"""Default limit of a whole :func:`spawn_local` run and of each collective."""

FORK_SERVER_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",  # DTensor: the runtime's optimizer groups and TP
    "torch._dynamo",  # what torch.optim's optimizers import when they are built
    "dflop.runtime.launch",
)
"""What the fork server of :func:`spawn_local` always imports before it forks a rank
(each of these took a rank about a second to import on its own)."""

_KILL_GRACE_S = 5.0  # how long to wait for a killed child to be reaped
_SETTLE_S = 0.3  # after a first failure, time for the others to report (to find the culprit)


class SpawnError(RuntimeError):
    """A rank of :func:`spawn_local` failed, was killed, or the run timed out.

    Attributes:
        rank: the first failing rank (None for a timeout).
        exitcode: its exit code (negative: killed by that signal), if it exited.
    """

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class ProcessInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    backend: str


def _loopback_interface() -> str | None:
    """The name of this host's loopback interface (``lo`` on Linux), if it has one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platforms without the call
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo0")), None)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _child_main(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    host: str,
    port: int,
    backend: str,
    collective_timeout_s: float,
    num_threads: int,
    conn: multiprocessing.connection.Connection,
    launcher_alive: multiprocessing.connection.Connection,
    listener: socket.socket | None = None,
) -> None:
    """Body of one spawned rank: join the group, run ``fn``, report back, exit. The rank
    dies with its launcher (:func:`_die_with`), so no rank outlives a killed run."""
    exitcode = 0
    _die_with(launcher_alive)
    try:
        # A local run talks over loopback only: gloo's and NCCL's bootstrap sockets bind
        # to the interface these name (a user's own setting wins).
        loopback = _loopback_interface()
        if loopback is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
        os.environ.update(
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        import torch
        import torch.distributed as dist

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # Rank 0 hosts the rendezvous store on the socket the launcher bound and listens on
        # (loopback only), so the port is known and held from before any rank starts: no
        # race on a "free" port, and the launcher itself never imports torch.
        if listener is not None:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=os.dup(listener.fileno()),  # the store owns its copy
                use_libuv=True,
            )
            listener.close()
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        result = fn(rank, world_size, *args)
        conn.send(("ok", result))
        # The work is done and reported: teardown trouble is not a failure.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    except BaseException as error:  # report everything, including SystemExit
        exitcode = error.code if isinstance(error, SystemExit) and error.code else 1
        if not isinstance(exitcode, int):
            exitcode = 1
        try:
            text = f"{type(error).__name__}: {error}"
            if _timed_out(error):  # a peer stopped responding: its traceback says nothing
                text = (
                    f"waited {collective_timeout_s:g} s (the collective timeout, --timeout-s) "
                    "for a peer rank that stopped responding (hung, or far slower than the "
                    f"others): {' '.join(str(error).split())[:300]}"
                )
            elif not isinstance(error, (WriteError, InUseError)):  # named: no traceback needed
                text += f"\n{traceback.format_exc()}"
            conn.send(("error", text, time.time()))
        except Exception:  # the parent may already be gone
            pass
    finally:
        try:
            conn.close()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Skip interpreter teardown: a half-torn-down process group (a peer died) can
            # block in its destructor, and the parent is waiting for this exit.
            os._exit(exitcode)


def _timed_out(error: BaseException) -> bool:
    """A collective or transfer that gave up waiting for a peer (gloo, NCCL)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        type(error).__name__ == "DistBackendError" or "timed out" in text or "timeout" in text
    )


def _die_with(launcher_alive: multiprocessing.connection.Connection) -> None:
    """Exit this process as soon as the launcher is gone (killed by SIGKILL, crashed):
    ``launcher_alive`` is the reading end of a pipe whose only writing end the launcher
    holds, so a daemon thread's read ends with EOF when the launcher's process ends (even
    before it is reaped). The ranks' parent is the fork server, not the launcher, so a
    parent-death signal would not fire; a rank left running would keep training and
    checkpointing while a restarted job uses the same folder."""
    import threading

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            launcher_alive.recv()  # the launcher never writes: this returns only on EOF
        os._exit(_LAUNCHER_GONE_EXIT)

    threading.Thread(target=watch, name="dflop-launcher-watch", daemon=True).start()


_LAUNCHER_GONE_EXIT = 125


class StopRequested:
    """Set when the launcher receives SIGTERM, or Ctrl-C where the launch asked for it
    (:func:`spawn_local` passes it on to the ranks): a training loop checks
    :meth:`requested` and stops cleanly; :attr:`reason` says which ("SIGTERM" or
    "Ctrl-C")."""

    _flag = False
    _interrupts = 0
    reason: str | None = None

    @classmethod
    def install(cls) -> None:
        """In a rank (main thread): SIGTERM and a first Ctrl-C (SIGINT) set the flag
        instead of killing; a second Ctrl-C stops at once (KeyboardInterrupt). Elsewhere
        (a rank of :func:`spawn_threads`) nothing: its launcher's thread installs it."""
        import threading

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda signum, frame: cls.set("SIGTERM"))
            signal.signal(signal.SIGINT, cls._on_interrupt)

    @classmethod
    def _on_interrupt(cls, signum: int, frame: Any) -> None:
        cls._interrupts += 1
        if cls._interrupts > 1:
            raise KeyboardInterrupt
        cls.set("Ctrl-C")

    @classmethod
    def set(cls, reason: str = "SIGTERM") -> None:
        if not cls._flag:
            cls.reason = reason
        cls._flag = True

    @classmethod
    def clear(cls) -> None:
        cls._flag = False
        cls._interrupts = 0
        cls.reason = None

    @classmethod
    def requested(cls) -> bool:
        return cls._flag


def spawn_local(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    *,
    collective_timeout_s: float | None = None,
    start_method: str | None = None,
    num_threads: int | None = None,
    stop_on_interrupt: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes.

    Each process gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set, joins the
    default process group (``backend``, collective timeout ``collective_timeout_s``,
    default ``timeout_s``) through a TCP store the parent hosts on a free port, runs
    ``fn`` and returns its (picklable) result. ``fn`` and ``args`` must be picklable
    (a module-level function).

    Returns:
        The results, in rank order.

    Raises:
        SpawnError: as soon as one rank raises, exits non-zero or is killed (the message
            names the rank and carries its traceback), or when the whole run takes longer
            than ``timeout_s``. The other ranks are killed first, so this never hangs.

    ``start_method``: multiprocessing start method; default ``"forkserver"`` where the
    platform has it, else ``"spawn"``. The fork server imports torch once and forks every
    rank from that clean process (no CUDA context, no thread pools: as safe as spawn), so
    a run after the first starts in a fraction of a second instead of each rank
    importing torch anew (:func:`start_fork_server` starts it earlier, with more modules).

    ``num_threads``: torch intra-op threads per process; default ``cpu_count // world_size``
    (at least 1), so local ranks do not oversubscribe the cores.

    SIGTERM to this process is passed on to the ranks (:class:`StopRequested`); with
    ``stop_on_interrupt`` a first Ctrl-C is too (the ranks stop after their current step;
    a second stops them at once), else Ctrl-C stops them at once.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    collective_timeout_s = float(
        timeout_s if collective_timeout_s is None else collective_timeout_s
    )
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    StopRequested.clear()  # a stop requested of an earlier run in this process is not ours
    host = "127.0.0.1"
    # The rendezvous socket is bound and listening before any rank starts; rank 0 serves
    # TCPStore on it (handed over with the process). Bound to loopback: TCPStore's server
    # would listen on every interface if it bound the port itself, and no other machine
    # may read or write the rendezvous (the store has no authentication). Ranks that
    # connect before rank 0 serves wait in the listen backlog.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(max(128, world_size))
    port = listener.getsockname()[1]
    if start_method is None:
        available = multiprocessing.get_all_start_methods()
        start_method = "forkserver" if "forkserver" in available else "spawn"
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        start_fork_server()  # the first time: torch imported once, not by every rank
    procs, conns = [], []
    # The ranks hold the reading end; only this process holds the writing end.
    alive_r, alive_w = ctx.Pipe(duplex=False)
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(
                    rank,
                    world_size,
                    fn,
                    tuple(args),
                    host,
                    port,
                    backend,
                    collective_timeout_s,
                    num_threads,
                    child_end,
                    alive_r,
                    listener if rank == 0 else None,
                ),
                name=f"dflop-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()  # the parent keeps only the reading end: EOF when the child ends
            procs.append(proc)
            conns.append(parent_end)
        with _forward_stop(procs, stop_on_interrupt):
            return _watch(procs, conns, timeout_s)
    finally:
        _kill_all(procs)
        for conn in conns:
            conn.close()
        alive_r.close()
        alive_w.close()
        listener.close()


_fork_server_started = False


FORK_SERVER_PRELOAD_ENV = "DFLOP_FORK_SERVER_PRELOAD"
"""``"0"``: the fork server preloads nothing (see :func:`start_fork_server`)."""


def start_fork_server(modules: Sequence[str] = ()) -> bool:
    """Start this process's fork server now, in the background, importing torch
    (:data:`FORK_SERVER_MODULES`) and ``modules`` once: every rank that
    :func:`spawn_local` forks from it later starts with them imported, and the imports
    overlap with what this process does until then (reading data, profiling, planning)
    instead of delaying the first step. A module that fails to import is left to the
    ranks (which then raise the error themselves).

    Returns False, doing nothing, where the platform has no fork server or this
    process's is running already (its modules are the ones it started with).
    ``DFLOP_FORK_SERVER_PRELOAD=0`` (:data:`FORK_SERVER_PRELOAD_ENV`) imports nothing
    there: a tool that starts in each rank (coverage.py) then sees the ranks import
    dflop, instead of finding it imported already and leaving it unmeasured."""
    global _fork_server_started
    if _fork_server_started or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    import atexit
    from multiprocessing import forkserver

    preload = list(dict.fromkeys([*FORK_SERVER_MODULES, *modules]))
    if os.environ.get(FORK_SERVER_PRELOAD_ENV) == "0":
        preload = []  # each rank imports its own modules (e.g. under coverage measurement)
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    forkserver.ensure_running()  # spawns the server and returns: it imports on its own
    _fork_server_started = True
    atexit.register(_stop_fork_server)
    return True


def _stop_fork_server() -> None:
    """At this process's exit: end its fork server at once. Left to itself it notices the
    exit only after finishing its imports, then tears down an interpreter holding torch
    (about a second), while it still holds this process's stdout and stderr open, so a
    caller reading them (a pipe, ``subprocess.run``) waits for it. Left alone while a
    process it forked still runs (:func:`spawn_local` kills and reaps its ranks)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # noqa: SLF001
    if not pid or multiprocessing.active_children():
        return  # not started (or another Python's layout); or a child still needs it
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def spawn_threads(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    device: str = "cpu",
    collective_timeout_s: float | None = None,
    stop_on_interrupt: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads of this process,
    ranks of one :class:`~dflop.runtime.thread_world.ThreadWorld` on ``device``: the
    runtime's collectives and transfers (:mod:`dflop.runtime.dist`) then stay in this
    process. For ranks that share one GPU (NCCL refuses two ranks on one device); on
    CUDA every rank computes on its own stream and transfers run on the world's
    communication stream.

    Returns:
        The results, in rank order.

    Raises:
        SpawnError: a rank raised (the message names the first and carries its
            traceback; the world is aborted, so the others stop at their next wait), or
            the run took longer than ``timeout_s``.
    """
    import threading

    import torch

    from dflop.runtime.thread_world import ThreadWorld, WorldStopped

    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    world = ThreadWorld(
        world_size, device, timeout_s if collective_timeout_s is None else collective_timeout_s
    )
    results: dict[int, Any] = {}
    # rank -> (when, traceback text, whether it is only a consequence of another failure)
    failures: dict[int, tuple[float, str, bool]] = {}
    lock = threading.Lock()
    StopRequested.clear()  # a stop requested of an earlier run in this process is not ours

    def body(rank: int) -> None:
        world.join(rank)
        try:
            stream = torch.cuda.Stream(world.device) if world.device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                result = fn(rank, world_size, *args)
            if stream is not None:
                stream.synchronize()
            with lock:
                results[rank] = result
        except BaseException as error:  # report everything, as spawn_local does
            text = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
            with lock:
                failures[rank] = (time.monotonic(), text, isinstance(error, WorldStopped))
            world.abort(RuntimeError(f"rank {rank} failed: {type(error).__name__}: {error}"))
        finally:
            world.leave()

    def first_failure_s() -> float | None:
        with lock:
            return min((f[0] for f in failures.values()), default=None)

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"dflop-rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        with _forward_stop([], stop_on_interrupt):
            for thread in threads:
                thread.start()
            # Until all finish, the deadline, or a grace period after the first failure
            # (the others stop at their next wait; one busy computing is not waited for).
            while (running := [r for r, t in enumerate(threads) if t.is_alive()]) and (
                time.monotonic() < deadline
            ):
                first = first_failure_s()
                if first is not None and time.monotonic() > first + _KILL_GRACE_S:
                    break
                threads[running[0]].join(0.1)
    except BaseException as error:  # a second SIGTERM, Ctrl-C: stop the ranks too
        world.abort(RuntimeError(f"the launcher stopped: {type(error).__name__}: {error}"))
        raise
    with lock:
        failed = dict(failures)
    if running and not failed:
        world.abort(RuntimeError(f"spawn_threads timed out after {timeout_s:g} s"))
        raise SpawnError(
            f"spawn_threads timed out after {timeout_s:g} s; ranks {running} of "
            f"{world_size} were still running (stopped at their next wait)"
        )
    if failed:
        # The cause: the earliest failure that is not just a rank stopped by the world.
        rank = min(failed, key=lambda r: (failed[r][2], failed[r][0]))
        text = f"rank {rank} of {world_size} failed:\n{failed[rank][1]}"
        others = sorted(r for r in failed if r != rank)
        if others:
            text += f"\n(ranks {others} failed after it)"
        raise SpawnError(text, rank=rank)
    return [results[rank] for rank in range(world_size)]


@contextlib.contextmanager
def _forward_stop(procs: list[Any], stop_on_interrupt: bool):
    """While the ranks run, SIGTERM to the launcher (a scheduler's stop), and with
    ``stop_on_interrupt`` Ctrl-C, is passed on to them so that they stop cleanly after
    their current step (:class:`StopRequested`), and the launcher keeps waiting for their
    results; a second signal kills them. Only in the main thread."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        interrupt = signum == signal.SIGINT
        StopRequested.set("Ctrl-C" if interrupt else "SIGTERM")
        if len(received) > 1:
            _kill_all(procs)
            if interrupt:
                raise KeyboardInterrupt
            raise SpawnError("stopped: a second SIGTERM killed the ranks")
        again = "Ctrl-C" if interrupt else "SIGTERM"
        print(
            f"{StopRequested.reason}: stopping after the current step ({again} again to "
            "stop at once)",
            file=sys.stderr,
            flush=True,
        )
        for proc in procs:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)

    signals = [signal.SIGTERM] + ([signal.SIGINT] if stop_on_interrupt else [])
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _watch(
    procs: list[Any], conns: list[multiprocessing.connection.Connection], timeout_s: float
) -> list[Any]:
    """Wait for every rank; raise at the first failure or at the deadline."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout_s
    messages: dict[int, tuple[Any, ...]] = {}
    finished: set[int] = set()

    def read(rank: int) -> None:
        if rank in messages:
            return
        try:
            if conns[rank].poll():
                messages[rank] = conns[rank].recv()
        except (EOFError, OSError):
            pass

    def failed(rank: int) -> bool:
        read(rank)
        message = messages.get(rank)
        if message is not None and message[0] == "error":
            return True
        exitcode = procs[rank].exitcode
        if exitcode is None:
            return False
        read(rank)  # a result sent just before exiting
        return exitcode != 0 or rank not in messages

    while len(finished) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            running = [r for r in range(world_size) if r not in finished]
            raise SpawnError(
                f"spawn_local timed out after {timeout_s:g} s; ranks {running} of "
                f"{world_size} were still running and have been killed"
            )
        waitables = [procs[r].sentinel for r in range(world_size) if r not in finished]
        waitables += [
            conns[r] for r in range(world_size) if r not in messages and r not in finished
        ]
        multiprocessing.connection.wait(waitables, timeout=min(remaining, 1.0))
        if any(failed(r) for r in range(world_size) if r not in finished):
            _raise_root_cause(procs, messages, failed)
        finished.update(r for r in range(world_size) if procs[r].exitcode == 0 and r in messages)
    return [messages[r][1] for r in range(world_size)]


def _raise_root_cause(
    procs: list[Any], messages: dict[int, tuple[Any, ...]], failed: Callable[[int], bool]
) -> None:
    """Report the failure that most likely caused the others.

    When one rank dies its peers soon fail too (a closed connection in a collective), so
    after the first failure the others are given a moment to report, then the culprit is
    chosen: a rank that vanished without a Python error (killed, ``os._exit``) cannot be a
    consequence of a peer's failure, so it wins; otherwise the earliest error by the
    ranks' own clocks.
    """
    world_size = len(procs)
    settle_until = time.monotonic() + _SETTLE_S
    while time.monotonic() < settle_until:
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.05)
    failures = [r for r in range(world_size) if failed(r)]
    silent = [r for r in failures if r not in messages or messages[r][0] != "error"]
    if silent:
        rank = silent[0]
        procs[rank].join(_KILL_GRACE_S)
        exitcode = procs[rank].exitcode
        text = f"rank {rank} of {world_size} {_describe_exit(exitcode)} without finishing its work"
    else:
        rank = min(failures, key=lambda r: messages[r][2])
        procs[rank].join(_KILL_GRACE_S)
        exitcode = procs[rank].exitcode
        text = f"rank {rank} of {world_size} failed:\n{messages[rank][1]}"
    others = [r for r in failures if r != rank]
    if others:
        text += f"\n(ranks {others} failed after it)"
    raise SpawnError(text + "\nThe other ranks have been killed.", rank=rank, exitcode=exitcode)


def _kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()  # SIGKILL: a rank stuck in a collective does not answer SIGTERM
    for proc in procs:
        proc.join(_KILL_GRACE_S)


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessInfo:
    """Join the default process group from torchrun's environment.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/MASTER_PORT through ``env://``).
    ``backend`` defaults to ``nccl`` when CUDA is available (then the current device is
    set to LOCAL_RANK) and ``gloo`` otherwise. ``timeout_s`` is the default timeout of
    every collective and receive: a rank whose peer died fails after it instead of
    hanging, and torchrun then tears the job down.
    """
    import torch
    import torch.distributed as dist

    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env needs {missing} in the environment (launch with torchrun, or use "
            "spawn_local for local processes)"
        )
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return ProcessInfo(rank, world_size, local_rank, backend)
