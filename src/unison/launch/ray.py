"""Workers placed, started and watched by Ray; driven by unison over TCP.

    controller (Ray driver)                       one Ray actor per worker, in a placement group
    network(): ray.init(), the node's IP  ---->   (ray assigns CPUs/GPUs; CUDA_VISIBLE_DEVICES)
    start(): placement groups, actors,
             actor.start(connect command) --->    Popen("python -m unison worker --connect ...")
                                                       |  relays its output, "[worker r] line"
    unison's TCP channel  <================================  the worker joins over TCP
    death()/stop(): bounded ray calls ------->    its exit status and stderr tail; kill

Ray places the workers, starts them and tells when a node or an actor dies; unison's own
TCP channel carries every call and result, never Ray's per-call RPC. One placement group,
``PACK``, for a session of one group; with ``num_groups`` > 1, one ``STRICT_PACK`` group per
unison group, so each group (tensor parallel) sits on one node and the groups spread.

What keeps nothing behind: the actors are never detached, so they die with the driver; each
worker's keeper kills the worker (and all it started) once its parent, the actor, is gone or
the controller's connection closes; ``stop`` kills the actors and removes the placement
groups. ``ray.init`` is process-global: a cluster this launcher joined, or the local one it
started because none was running, stays up after the session (``ray.shutdown()`` is yours).
"""

from __future__ import annotations

import collections
import math
import numbers
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - ray is an extra
    raise ImportError(
        "Session(launcher='ray') needs Ray: pip install 'unison[ray]'"
    ) from exc

from unison._fdwait import readable
from unison.deadline import seconds
from unison.errors import start_timed_out
from unison.launch import DeathReport, Launcher, Network, connect_command
from unison.spec import WorkerSpec

__all__ = ["RayLauncher"]

_RAY: Any = ray
"""ray, for its functions that lack annotations."""
_TAIL_CHARS = 64 * 1024
"""How much of a worker's stderr its actor keeps, as its last lines, for WorkerDied."""
_CALL_GRACE = 5.0
"""Seconds a Ray call of start/stop may take beyond the wait it asks for (a busy cluster)."""
_ANSWER_S = 0.5
"""How long death() and stop() wait for an actor to answer: its worker's connection has
closed, so a live actor answers in milliseconds; one that does not is most likely gone with
its node (Ray itself can take seconds to say so)."""
_LET_GO_S = 5.0
"""How long stop() waits for Ray to kill the actors and remove the placement groups (each a
call to its GCS, milliseconds; a GCS that is gone would hold it for good)."""
_ENDED_EVERY = 0.05
"""ended() asks Ray at most this often (it is polled; the TCP connection is the main signal)."""


class _WorkerHost:
    """The Ray actor of one worker: it runs the worker as a child process, relays its output
    and reports its end. Threaded (max_concurrency), so ``wait`` never blocks ``report``.

    It also watches its raylet (its parent): when the node's raylet dies (the node removed
    or lost), it kills the worker at once, so the controller sees the connection close
    within milliseconds rather than once Ray's core worker notices (a second or two)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: collections.deque[str] = collections.deque()
        self.tail_chars = 0
        self.lock = threading.Lock()
        self.relays: list[threading.Thread] = []
        self.why = ""
        """Why the actor killed its worker by itself, if it did."""

    def start(self, argv: list[str], env: dict[str, str]) -> tuple[str, str, int]:
        """Start the worker; return where it runs: (node IP, Ray node id, pid)."""
        full_env = dict(os.environ)
        full_env.update(env)
        # the node's own interpreter (the driver's path may not exist here); the worker
        # ends with this actor, whatever ends it
        argv = [sys.executable, *argv[1:]]
        if "--die-with-parent" not in argv:
            argv.append("--die-with-parent")
        raylet = os.getppid()
        self.proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for stream, is_err in ((self.proc.stdout, False), (self.proc.stderr, True)):
            assert stream is not None
            relay = threading.Thread(target=self._relay, args=(stream, is_err), daemon=True,
                                     name=f"unison-relay-{self.rank}")
            relay.start()
            self.relays.append(relay)
        if raylet > 1:
            threading.Thread(target=self._watch_raylet, args=(raylet,), daemon=True,
                             name=f"unison-raylet-watch-{self.rank}").start()
        ctx = ray.get_runtime_context()
        return _RAY.util.get_node_ip_address(), ctx.get_node_id(), self.proc.pid

    def _watch_raylet(self, raylet: int) -> None:
        try:
            fd = os.pidfd_open(raylet)
        except (AttributeError, OSError):
            fd = -1
        try:
            while self.proc is not None and self.proc.poll() is None:
                if fd >= 0:
                    if readable([fd], 1.0):
                        break
                elif os.getppid() != raylet:
                    break
                else:
                    time.sleep(0.1)
            else:
                return
        finally:
            if fd >= 0:
                os.close(fd)
        if self.proc is not None and self.proc.poll() is None:
            self.why = (f"its Ray node's raylet (pid {raylet}) died, so its actor killed it "
                        "(the node was removed or lost)")
            self.kill()

    def _relay(self, stream: IO[bytes], is_err: bool) -> None:
        out = sys.stderr if is_err else sys.stdout
        prefix = f"[worker {self.rank}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")[-_TAIL_CHARS:]
            if is_err:
                with self.lock:
                    self.tail.append(line + "\n")
                    self.tail_chars += len(line) + 1
                    while self.tail_chars > _TAIL_CHARS and len(self.tail) > 1:
                        self.tail_chars -= len(self.tail.popleft())
            try:
                out.write(prefix + line + "\n")
                out.flush()
            except Exception:  # never stop relaying: a full pipe would block the worker
                pass
        stream.close()

    def wait(self, timeout: float | None) -> int | None:
        """The worker's exit status once it ends (None if it still runs after ``timeout``)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def watch(self) -> tuple[int | None, str]:
        """Return once the worker ends: (its exit status, why, where the actor knows)."""
        code = self.wait(None)
        return code, self.why  # the raylet watcher sets why before it kills

    def report(self, grace: float) -> tuple[int | None, str, str]:
        """Wait up to ``grace`` for the worker to end, kill it (and all below it) if it still
        runs; return (exit status, stderr tail, why it ended where the actor knows)."""
        code = self.wait(grace)
        why = self.why
        if code is None and self.proc is not None:
            why = "its connection broke while it still ran, so unison killed it"
            self.kill()
            code = self.wait(1.0)
        for relay in self.relays:
            relay.join(0.5)
        with self.lock:
            return code, "".join(self.tail), why

    def kill(self) -> None:
        """SIGKILL the worker's keeper and every process below it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        from unison import _proctree

        _proctree.kill_tree(self.proc.pid)
        self.proc.kill()
        self.proc.wait()


_actor_class: Any = None


def _host_class() -> Any:
    """The Ray actor class (made once per process: ``ray.remote`` registers it)."""
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(_WorkerHost)
    return _actor_class


class RayLauncher(Launcher):
    """Workers as Ray actors, one per worker, in placement groups; they join over TCP.

    ``address`` goes to ``ray.init`` (None: ``RAY_ADDRESS`` or the running cluster, else a new
    local one, as ``ray.init()`` does; not called when Ray is initialised already), with
    ``ray_init_kwargs``. Each worker's bundle and actor ask ``num_cpus``, ``num_gpus`` and
    ``resources``; Ray assigns the GPUs, and each worker sees only its own. Placement waits
    ``placement_timeout`` seconds, then raises TimeoutError naming what did not fit.

    A session of one group is one placement group, ``PACK``; with ``num_groups`` > 1, each
    unison group is a placement group of its own, ``group_strategy`` (``STRICT_PACK``: all
    of a group on one node; ``PACK`` lets a group that fits no single node spread).

    ``nice``: the workers' niceness; None, the driver's. Ray starts actors at 15, below
    everything else on the node; unison's workers are the job's compute, so by default they
    run as a local session's would."""

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: Mapping[str, float] | None = None,
        ray_init_kwargs: Mapping[str, Any] | None = None,
        placement_timeout: float = 60,
        group_strategy: str = "STRICT_PACK",
        nice: int | None = None,
    ) -> None:
        # checked here: Ray takes a negative amount into a placement group, then its raylet
        # aborts on removing it (the node, and all it ran, is lost)
        num_cpus, num_gpus = _amount("num_cpus", num_cpus), _amount("num_gpus", num_gpus)
        resources = {k: _amount(f"resources[{k!r}]", v) for k, v in (resources or {}).items()}
        self.address = address
        self.nice = os.getpriority(os.PRIO_PROCESS, 0) if nice is None else nice
        """The workers' niceness (see the class docstring); set by unison.worker.set_niceness."""
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.resources = dict(resources or {})
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.placement_timeout = seconds(placement_timeout, "placement_timeout", none=False)
        """Checked when made (inf: for ever): nan, -1 or "5" reached ray.wait, whose errors
        named no parameter (an audit of timeouts, issue 9, forty-eighth pass)."""
        self.group_strategy = group_strategy
        self.groups: list[Any] = []
        """The placement groups, one per unison group (or one for the whole session)."""
        self.actors: list[Any] = []
        self.where: dict[int, tuple[str, str, int]] = {}
        """rank -> (node IP, Ray node id, worker pid), once started."""
        self._exit_of: dict[int, Any] = {}
        """Outstanding ``wait`` calls, one per worker: ready once it ends or its actor dies."""
        self._exits: dict[Any, int] = {}
        """The same, by call."""
        self._ended: int | None = None
        self._last_poll = 0.0
        self._started = False
        self.stopped = False

    # -- the Launcher interface --------------------------------------------------------

    def network(self) -> Network:
        if not ray.is_initialized():
            ray.init(address=self.address, **self.ray_init_kwargs)
        ip = _RAY.util.get_node_ip_address()
        return Network(bind=ip, advertise=ip, secret=secrets.token_bytes(32))

    def describe(self, rank: int) -> str:
        where = self.where.get(rank)
        actor = self._actor_id(rank)
        if where is None:
            return f"(Ray actor {actor})" if actor else ""
        ip, node, pid = where
        return f"on node {ip} (Ray node {node[:12]}, actor {actor}, pid {pid})"

    def start(self, specs: Sequence[WorkerSpec], env: Mapping[int, Mapping[str, str]]) -> None:
        if self._started or self.stopped:
            raise RuntimeError("a RayLauncher starts its workers once: make a new one")
        self._started = True
        if not ray.is_initialized():  # a caller that skipped network()
            ray.init(address=self.address, **self.ray_init_kwargs)
        try:
            self._start(specs, env)
        except BaseException:
            self.stop(grace=0)
            raise

    def local_ranks(self, num_workers: int, num_groups: int) -> frozenset[int]:
        """Place the workers now, and say which landed on the driver's node: those use
        shared memory (channel.mixed), the others TCP."""
        here = _RAY.get_runtime_context().get_node_id()
        nodes = self.nodes(num_workers, num_groups)
        return frozenset(rank for rank, node in nodes.items() if node == here)

    def nodes(self, num_workers: int, num_groups: int) -> dict[int, str]:
        """Place the workers (once), and say on which Ray node each one's bundle is."""
        self._place(num_workers, num_groups)
        size = num_workers // max(num_groups, 1)
        tables = [_RAY.util.placement_group_table(pg).get("bundles_to_node_id", {})
                  for pg in self.groups]
        out = {}
        for rank in range(num_workers):
            table = tables[rank // size] if num_groups > 1 else tables[0]
            node = table.get(rank % size if num_groups > 1 else rank)
            if node:
                out[rank] = str(node)
        return out

    def _place(self, n: int, num_groups: int) -> None:
        """One placement group per unison group (or one for the session), ready; once."""
        if self.groups:
            return
        if self.stopped:  # (a session that failed to open with it: stop() came and went,
            # so groups placed now would stay for the driver's life)
            raise RuntimeError("a RayLauncher starts its workers once: make a new one")
        if not ray.is_initialized():
            ray.init(address=self.address, **self.ray_init_kwargs)
        try:
            self._place_groups(n, num_groups)
        except BaseException:
            for pg in self.groups:
                _removed(pg)
            self.groups = []
            raise

    def _place_groups(self, n: int, num_groups: int) -> None:
        size = n // max(num_groups, 1)
        bundle: dict[str, float] = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        bundle = {k: v for k, v in bundle.items() if v}
        strategy = self.group_strategy if num_groups > 1 else "PACK"
        counts = [size] * num_groups if num_groups > 1 else [n]
        self.groups = [placement_group([dict(bundle)] * c, strategy=strategy) for c in counts]
        pending = [pg.ready() for pg in self.groups]
        wait, start_cut = self._limit(self.placement_timeout)
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait)
        if len(ready) < len(pending):
            if start_cut:
                raise TimeoutError(start_timed_out(list(range(n))) + " (Ray was still "
                                   "placing them)")
            per = f"{size} bundles of {bundle} on one node ({strategy})" if num_groups > 1 \
                else f"{n} bundles of {bundle} ({strategy})"
            for pg in self.groups:  # first: what they hold is not "available" to them
                _removed(pg)
            self.groups = []
            raise TimeoutError(
                f"Ray could not place the session's {n} workers within "
                f"{self.placement_timeout:g} s: {len(pending) - len(ready)} of "
                f"{len(pending)} placement group(s) of {per} did not fit. Available now: "
                f"{_available()}"
            )
        ray.get(ready)

    def _limit(self, wait: float) -> tuple[float | None, bool]:
        """``wait`` seconds (None: for ever, where it is inf), or what is left to the
        session's start deadline where that is less; and whether the deadline is what cut
        it."""
        if self.start_deadline is None:
            return (None if wait == math.inf else wait), False
        left = max(0.0, self.start_deadline - time.monotonic())
        return min(wait, left), left < wait

    def _start(self, specs: Sequence[WorkerSpec], env: Mapping[int, Mapping[str, str]]) -> None:
        n = len(specs)
        num_groups = specs[0].num_groups if specs else 1
        size = n // max(num_groups, 1)
        self._place(n, num_groups)
        host = _host_class()
        for rank in range(n):
            pg = self.groups[rank // size] if num_groups > 1 else self.groups[0]
            index = rank % size if num_groups > 1 else rank
            actor = host.options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index),
                max_concurrency=4, max_restarts=0,
            ).remote(rank)
            self.actors.append(actor)
        calls = []
        for rank, (spec, actor) in enumerate(zip(specs, self.actors)):
            argv, adds = connect_command(spec)
            argv += ["--nice", str(self.nice)]
            worker_env = {**adds, **{str(k): str(v) for k, v in env.get(rank, {}).items()}}
            calls.append(actor.start.remote(argv, worker_env))
        # actors start fresh Python processes: give them the placement timeout too
        limit, start_cut = self._limit(self.placement_timeout + _CALL_GRACE)
        try:
            results = ray.get(calls, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            if start_cut:
                raise TimeoutError(start_timed_out(list(range(n))) + " (their Ray actors "
                                   "were still starting)") from None
            raise TimeoutError(f"the session's Ray actors did not start their workers within "
                               f"{limit or 0:g} s") from None
        for rank, result in enumerate(results):
            self.where[rank] = (str(result[0]), str(result[1]), int(result[2]))
        self._exit_of = {rank: actor.watch.remote() for rank, actor in enumerate(self.actors)}
        self._exits = {ref: rank for rank, ref in self._exit_of.items()}

    def watch_fds(self) -> list[int]:
        return []  # a remote worker's end shows as its TCP connection closing

    def ended(self) -> int | None:
        """A worker whose process exited or whose actor died, as far as Ray has told us
        (asked at most every _ENDED_EVERY seconds; never blocks)."""
        if self._ended is not None or self.stopped or not self._exits:
            return self._ended
        now = time.monotonic()
        if now - self._last_poll < _ENDED_EVERY:
            return None
        self._last_poll = now
        try:
            ready, _ = ray.wait(list(self._exits), num_returns=1, timeout=0)
        except Exception:
            return None
        if ready:
            self._ended = self._exits[ready[0]]
        return self._ended

    def death(self, rank: int, grace: float) -> DeathReport:
        """Ask worker ``rank``'s actor for its exit status and stderr tail; if the actor
        itself is gone, say so, and where. Bounded: about ``grace`` + 1 s at most, and
        _ANSWER_S where the actor does not answer at all."""
        if rank >= len(self.actors):
            return DeathReport(rank, None, "", "it was never started")
        limit = grace + 1.0
        deadline = time.monotonic() + limit
        try:
            report = self.actors[rank].report.remote(grace)
            exit_ref = self._exit_of.get(rank)
            pending = [report] if exit_ref is None else [exit_ref, report]
            # the first answer: its exit status (at once where the actor lives), the
            # actor's death (an in-flight call fails as soon as its process is gone), or
            # the report (which waits for the worker to end, then kills it)
            ready, _ = ray.wait(pending, num_returns=1, timeout=min(limit, _ANSWER_S))
            if not ready:  # its connection closed, so the worker is gone: its actor with it?
                return DeathReport(rank, None, "", f"its Ray actor did not answer within "
                                   f"{min(limit, _ANSWER_S):g} s: it or its node is probably "
                                   f"gone ({self.describe(rank)})")
            if exit_ref is not None and exit_ref in ready:
                code, why = ray.get(exit_ref)
                try:  # its output, briefly: the actor is alive, and so is the report
                    _, output, _ = ray.get(
                        report, timeout=max(0.1, min(0.5, deadline - time.monotonic())))
                except Exception:
                    output = ""
                return DeathReport(rank, code, output, why)
            code, output, why = ray.get(report, timeout=max(0.1, deadline - time.monotonic()))
            return DeathReport(rank, code, output, why)
        except ray.exceptions.RayActorError as exc:
            return DeathReport(rank, None, "", self._actor_died(rank, exc))
        except ray.exceptions.GetTimeoutError:
            return DeathReport(rank, None, "", f"its Ray actor did not answer within "
                               f"{limit:g} s ({self.describe(rank)})")
        except Exception as exc:  # a Ray call may fail in many ways: report, never hang
            first = str(exc).splitlines()[0] if str(exc) else ""
            return DeathReport(rank, None, "", f"Ray could not tell ({type(exc).__name__}: "
                               f"{first})")

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` for the workers to exit (asking their actors, bounded), then
        kill the actors (their workers die with them) and remove the placement groups.
        Idempotent. Ray itself stays initialised (see the module's docstring)."""
        if self.stopped:
            return
        self.stopped = True
        self._exits = {}
        try:
            exits = list(self._exit_of.values())
            done: list[Any] = []
            if exits:  # the workers' ends (or their actors' deaths) as Ray tells them
                done, _ = ray.wait(exits, num_returns=len(exits), timeout=max(grace, 0.0))
            # kill what still runs, and everything below it; an actor that does not answer
            # soon is gone or going (its node lost): ray.kill below settles it either way
            kills = [self.actors[rank].kill.remote() for rank, ref in self._exit_of.items()
                     if ref not in done]
            if kills:
                ray.wait(kills, num_returns=len(kills), timeout=_ANSWER_S)
        except Exception:
            pass  # dead actors, a lost cluster: kill what can be killed below
        actors, groups = self.actors, self.groups

        def let_go() -> None:
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
            for pg in groups:
                _removed(pg)

        # on a thread, waited for a while: with the cluster's GCS gone, removing a placement
        # group waits for it for good (Ray's driver ends itself some 60 s later), and a
        # close, the WorkerDied that follows a death, hung with it
        going = threading.Thread(target=let_go, daemon=True, name="unison-ray-stop")
        going.start()
        going.join(_LET_GO_S)

    # -- helpers ----------------------------------------------------------------------

    def _actor_id(self, rank: int) -> str:
        if rank >= len(self.actors):
            return ""
        try:
            return str(self.actors[rank]._actor_id.hex())[:12]
        except Exception:
            return ""

    def _actor_died(self, rank: int, exc: BaseException) -> str:
        cause = " ".join(str(exc).split())
        where = self.where.get(rank)
        node = f" on node {where[0]} (Ray node {where[1][:12]})" if where is not None else ""
        # Ray's own cause (its GCS's texts): "... because its node has died. Node Id: ...",
        # or "... because its worker process has died ..." (whose text goes on about "the
        # OOMing node", so no looser test of the words "node" and "died" will do)
        if "because its node has died" in cause:
            why = "its node died or was removed"
        elif "killed by `ray.kill`" in cause:
            why = "its actor was killed (ray.kill)"
        else:
            why = "the actor's process ended"
        return f"its Ray actor died{node}: {why} (Ray: {cause[:300]})"


def _amount(name: str, value: object) -> float:
    """A resource amount as a float (a numpy number too, which Ray's own checks refuse);
    ValueError unless it is a finite number >= 0."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0 <= float(value) < math.inf):
        raise ValueError(f"RayLauncher's {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _removed(pg: Any) -> None:
    try:
        remove_placement_group(pg)
    except Exception:
        pass


def _available() -> str:
    """What the cluster has free, less the placement groups' own resource names."""
    try:
        free = _RAY.available_resources()
    except Exception:
        return "unknown"
    return str({k: v for k, v in free.items() if "_group_" not in k})
