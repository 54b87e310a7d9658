"""Ranks as Ray actors: the launcher of a served worker. A worker of TP size N is N Ray actors in
one placement group of N bundles packed on one node (``cluster/launcher.py`` makes it): the worker's
own actor, in bundle 0, is rank 0 and starts ranks 1..N-1 here, one per bundle.

Each rank's actor connects to a Unix socket in the worker's private rendezvous directory (mode
0700: only this user reaches it), says which rank it is, and receives the KV cache's memfd
(``SCM_RIGHTS``), its spec and then its step plans over that connection, as a rank process does
over its pipes. The actors are the worker actor's: Ray ends them if it dies.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.parallel.ranks import RankLauncher, RankLink, end_links
from pdserve.logs import configure_text_logging, text_log_level

_RANK = 8  # bytes: the rank number a connecting actor sends first


class RankActor:
    """One rank, in a Ray actor of its own. ``run`` is its whole life (it returns when the driver
    closes the connection, or a step fails).

    ``log_level``: the worker's compact TEXT logging, installed in this process too
    (pdserve/logs.py); None leaves its logging as it is."""

    def __init__(self, log_level: str | None = None) -> None:
        if log_level is not None:
            configure_text_logging(log_level)

    def run(self, socket_path: str, rank: int) -> int:
        from pdserve.engine.parallel.rank_main import run_rank
        from pdserve.engine.parallel.step_plan import read_frame

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(socket_path)
            sock.sendall(rank.to_bytes(_RANK, "little"))
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if len(fds) != 1:
                return 1
            with sock.makefile("rb") as frames:
                first = read_frame(frames)
                if first is None:
                    return 1

                context = ray.get_runtime_context()
                where = {"node_id": context.get_node_id(), "placement_group_id": context.get_placement_group_id()}

                def report(message: dict[str, Any]) -> None:
                    sock.sendall((json.dumps({**message, **where}) + "\n").encode())

                return run_rank({**json.loads(first), "kv_fd": fds[0]}, frames, report)


class ActorLink(RankLink):
    """A rank in a Ray actor, reached over its Unix connection."""

    def __init__(self, rank: int, actor: Any, done: ray.ObjectRef, conn: socket.socket) -> None:
        self.rank, self.actor, self.done, self.conn = rank, actor, done, conn
        self.reports = conn.makefile("rb")

    def write(self, frame: bytes) -> None:
        self.conn.sendall(frame)

    def exit_status(self) -> str | None:
        ready, _ = ray.wait([self.done], timeout=0)
        return None if not ready else _outcome(self.done)

    def close_input(self) -> None:
        try:
            self.conn.shutdown(socket.SHUT_WR)  # the rank's frames end: it returns
        except OSError:
            pass

    def finish(self, deadline: float) -> None:
        ray.wait([self.done], timeout=max(0.0, deadline - time.monotonic()))
        self.reports.close()
        self.conn.close()
        ray.kill(self.actor, no_restart=True)  # its process (and its bundle's share) goes now


def _outcome(done: ray.ObjectRef) -> str:
    try:
        return f"exited with code {ray.get(done, timeout=5)}"
    except ray.exceptions.RayActorError as e:
        return f"died ({str(e).strip().splitlines()[0][:200]})"
    except Exception as e:  # noqa: BLE001 - any other end is an end
        return f"ended ({type(e).__name__}: {e})"


def _bundle_options(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray actor options asking for exactly one bundle's resources."""
    rest = dict(bundle)
    options: dict[str, Any] = {"num_cpus": rest.pop("CPU", 0.0), "num_gpus": rest.pop("GPU", 0.0)}
    if "memory" in rest:
        options["memory"] = rest.pop("memory")
    options["resources"] = {k: v for k, v in rest.items() if not k.startswith("node:")}
    return options


class ActorLauncher(RankLauncher):
    """Ranks 1..N-1 in bundles 1..N-1 of the placement group the calling actor runs in."""

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self._path: str | None = None

    def launch(self, specs: list[dict[str, Any]], kv_fd: int, deadline: float) -> list[RankLink]:
        # (Asked outside Ray, get_current_placement_group would start a local Ray of its own.)
        group = ray.util.get_current_placement_group() if ray.is_initialized() else None
        size = len(specs) + 1
        if group is None:
            raise RuntimeError("tensor-parallel ranks as Ray actors: this worker is not in a placement group "
                               "(distributed_executor_backend 'ray' is for workers `pdserve up` starts)")  # fmt: skip
        bundles = ray.util.placement_group_table(group)["bundles"]
        if len(bundles) < size:
            raise RuntimeError(f"tensor-parallel size {size}: the worker's placement group has {len(bundles)} bundles")
        self._path = os.path.join(os.path.dirname(specs[0]["store"]), "ranks.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._path)
        self._listener.listen(size)
        remote = ray.remote(RankActor)
        started: dict[int, tuple[Any, ray.ObjectRef]] = {}
        links: list[RankLink] = []
        try:
            for spec in specs:
                rank = int(spec["rank"])
                strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
                actor = remote.options(max_restarts=0, scheduling_strategy=strategy,
                                       **_bundle_options(bundles[rank])).remote(text_log_level())  # fmt: skip
                started[rank] = (actor, actor.run.remote(self._path, rank))
            conns = self._accept(started, deadline)
            for spec in specs:
                rank = int(spec["rank"])
                conn = conns.pop(rank)
                socket.send_fds(conn, [b"F"], [kv_fd])
                body = json.dumps(spec).encode()
                conn.sendall(len(body).to_bytes(8, "little") + body)
                links.append(ActorLink(rank, *started.pop(rank), conn))
        except BaseException:
            end_links(links, 0.0)
            for actor, _ in started.values():
                ray.kill(actor, no_restart=True)
            raise
        finally:
            self.close()  # every rank is connected (or none will be): no more connections are taken
        return links

    def _accept(self, started: dict[int, tuple[Any, ray.ObjectRef]], deadline: float) -> dict[int, socket.socket]:
        """Each started rank's connection, by rank; RuntimeError when a rank ends first or the
        deadline passes (connections made are closed)."""
        assert self._listener is not None
        conns: dict[int, socket.socket] = {}
        try:
            while len(conns) < len(started):
                ended = [r for r, (_, done) in started.items() if r not in conns and ray.wait([done], timeout=0)[0]]
                if ended:
                    raise RuntimeError(f"tensor-parallel rank {ended[0]}: {_outcome(started[ended[0]][1])}")
                if time.monotonic() >= deadline:
                    missing = sorted(set(started) - set(conns))
                    raise RuntimeError(f"tensor-parallel rank(s) {missing} did not start in time "
                                       "(ParallelConfig.start_timeout_s; is the placement group placed?)")  # fmt: skip
                self._listener.settimeout(0.5)
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(10.0)
                rank = int.from_bytes(_read_exact(conn, _RANK), "little")
                conn.settimeout(None)
                if rank not in started or rank in conns:
                    conn.close()
                    continue
                conns[rank] = conn
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        return conns

    def close(self) -> None:
        """Stop listening for ranks (idempotent)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a rank's connection closed before it said which rank it is")
        data += chunk
    return data
