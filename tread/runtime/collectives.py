"""Collective timeouts that name the rank that was waited for: `with watch_collectives(minutes): ...` on every
rank, once, after the process group exists (docs/reliability.md, "A stopped or lost rank").
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import re
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from tread.runtime.processes import describe_process, process_start_ticks
from tread.utils.errors import UserError

log = logging.getLogger(__name__)

CONFIG_KEY = "train.collective_timeout_min"
KEY_PREFIX = "tread/collectives"
MAX_NAMED = 8                 # ranks named one by one in a message; the rest are counted

# What a collective that failed because of a peer raises: gloo's messages carry its source path
# (".../gloo/transport/tcp/pair.cc"); NCCL's name NCCL or its watchdog.
_COMM_ERROR = re.compile(r"gloo|nccl|collective operation timeout|ProcessGroup", re.IGNORECASE)
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)

_generation = 0               # monitors started by this process: every rank starts them in the same order


class CollectiveTimeout(UserError):
    """A collective failed because a peer rank did not answer (or this rank came after the others gave up)."""


def timeout_delta(timeout_min: float) -> datetime.timedelta:
    """`timeout_min` minutes as a timedelta; ValueError unless a positive finite number."""
    if isinstance(timeout_min, bool) or not isinstance(timeout_min, (int, float)) \
            or not math.isfinite(timeout_min) or timeout_min <= 0:
        raise ValueError(f"{CONFIG_KEY} must be a positive number of minutes, got {timeout_min!r}")
    return datetime.timedelta(minutes=timeout_min)


def heartbeat_period(timeout_sec: float) -> float:
    """Seconds between heartbeats for a collective timeout of `timeout_sec`."""
    return min(5.0, max(0.1, timeout_sec / 20))


def roll_call_sec(timeout_sec: float) -> float:
    """How long a failing rank watches the other ranks' heartbeats before naming the still ones."""
    return max(2.0, 4 * heartbeat_period(timeout_sec))


def set_collective_timeout(timeout_min: float) -> bool:
    """Set the timeout of every later operation of the default process group (all its backends). False
    (nothing done) without a process group."""
    delta = timeout_delta(timeout_min)
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.set_timeout(delta)
    return True


@contextlib.contextmanager
def watch_collectives(timeout_min: Optional[float]) -> Iterator[Optional["CollectiveMonitor"]]:
    """Every rank, once, after the process group exists: set the collective timeout, start the heartbeat, and turn a
    collective that fails for a peer into CollectiveTimeout naming the rank. Yields the monitor (or None)."""
    if timeout_min is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        timeout_min is None or timeout_delta(timeout_min)   # a bad value is reported even on one process
        yield None
        return
    try:
        monitor = CollectiveMonitor(timeout_min)
    except Exception as err:  # noqa: BLE001 - the run goes on with the timeout alone, unnamed ranks
        set_collective_timeout(timeout_min)
        log.warning("collective monitor not started (%s: %s): a stopped or lost rank will not be named",
                    type(err).__name__, err)
        yield None
        return
    try:
        yield monitor
    except Exception as err:
        converted = monitor.explain(err)
        if converted is None:
            raise
        raise converted from err
    finally:
        monitor.stop()


def is_comm_error(err: BaseException) -> bool:
    """True for an error a collective raises when a peer or the transport fails (also as a cause/context)."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, dist.DistError):
            return True
        if isinstance(err, RuntimeError) and _COMM_ERROR.search(str(err)):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _is_timeout(err: BaseException) -> bool:
    return bool(_TIMEOUT.search(str(err))) or isinstance(err, TimeoutError)


def _tcp_store(store: Any) -> Optional[Any]:
    """The TCPStore under the default store's PrefixStores, or None if it is another kind."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def _ranks(ranks: Sequence[int]) -> str:
    head = ", ".join(str(r) for r in ranks[:MAX_NAMED])
    more = f" and {len(ranks) - MAX_NAMED} more" if len(ranks) > MAX_NAMED else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {head}{more}"


def _timed(fn: Callable[[], Any], seconds: float) -> Any:
    """fn() run in a daemon thread that gets `seconds`: a TCPStore call to a stopped store host blocks for
    good, whatever the store's timeout. TimeoutError if it has not returned by then (the thread is left)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="collective-store-call")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"the store did not answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class CollectiveMonitor:
    """This rank's heartbeat and what it knows of the others; made and stopped by watch_collectives."""

    def __init__(self, timeout_min: float):
        global _generation
        _generation += 1
        self.timeout_min = timeout_min
        self.timeout_sec = timeout_delta(timeout_min).total_seconds()
        self.period = heartbeat_period(self.timeout_sec)
        self.answer_sec = max(2.0, 2 * self.period)     # a store call taking longer: the store does not answer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.prefix = f"{KEY_PREFIX}/{_generation}"
        self.host = socket.gethostname()
        default = dist.distributed_c10d._get_default_store()
        self._tcp = _tcp_store(default)
        self.store_addr = f"{self._tcp.host}:{self._tcp.port}" if self._tcp is not None else None
        set_collective_timeout(timeout_min)
        # Two connections of our own (the heartbeat's and the roll call's), made while the store is known to
        # be up; without a TCPStore (file:// rendezvous) the default store serves both.
        self._beat_store, self._probe = self._client(default), self._client(default)
        self._beat_store.set(self._key("who", self.rank), json.dumps(
            {"pid": os.getpid(), "host": self.host, "start_ticks": process_start_ticks(os.getpid())}))
        self._beat_store.add(self._key("beat", self.rank), 1)
        self._beat_store.add(self._key("joined"), 1)
        self._beat_store.add(self._key("ending"), 0)
        self._joined = False
        self._ending = False                               # a rank failed or left: no more early notices
        self._explaining = False                           # this rank's block raised
        self._first_failed: Optional[int] = None          # the first rank that gave up, as the heartbeat saw
        self._verdict: Optional[dict[str, Any]] = None    # its finding: {"rank", "kind", "culprits", "message"}
        self._watched = list(range(1, self.world)) if self.rank == 0 else [0]
        self._last: dict[int, Any] = {}
        self._still_since: dict[int, float] = {}
        self._warned: set[int] = set()
        self._last_ok = time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=target, daemon=True, name=f"collective-{name}-rank{self.rank}")
                         for target, name in ((self._beat, "heartbeat"), (self._sentinel, "store-sentinel"))]
        for thread in self._threads:
            thread.start()

    def _key(self, kind: str, rank: Optional[int] = None) -> str:
        return f"{self.prefix}/{kind}" if rank is None else f"{self.prefix}/{kind}/{rank}"

    def _client(self, default: Any) -> Any:
        if self._tcp is None:
            return default
        return dist.TCPStore(self._tcp.host, self._tcp.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=self.answer_sec))

    def stop(self) -> None:
        """End the heartbeat (idempotent); the store's host (rank 0) then waits briefly for the other ranks to stop
        theirs, since the store ends with its process."""
        if self._stop.is_set():
            return
        self._stop.set()
        deadline = time.monotonic() + 1.0
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._explaining:
            return                    # a failure: the findings are out, rank 0 has waited in _conclude
        store = self._probe
        try:
            left = _timed(lambda: (store.add(self._key("ending"), 1), store.add(self._key("left"), 1))[1],
                          self.answer_sec)
            if self._hosts_store():
                deadline = time.monotonic() + 2 * self.answer_sec + self.period
                while left < self.world and time.monotonic() < deadline:
                    time.sleep(min(self.period, 0.1))
                    left = _timed(lambda: store.add(self._key("left"), 0), self.answer_sec)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
            pass

    # -- the heartbeat threads -----------------------------------------------------------------------------

    def _beat(self) -> None:
        """Every period: count this rank's heartbeat and watch the others' (rank 0 all, the rest rank 0)."""
        while not self._stop.wait(self.period):
            try:
                self._beat_once(self._beat_store)
            except Exception:  # noqa: BLE001 - the store does not answer; the sentinel tells
                pass

    def _beat_once(self, store: Any) -> None:
        store.add(self._key("beat", self.rank), 1)
        if not self._joined:
            self._joined = store.add(self._key("joined"), 0) >= self.world
        values = store.multi_get([self._key("beat", r) for r in self._watched]) if self._joined else []
        self._ending = self._ending or store.add(self._key("ending"), 0) > 0
        if self._ending and self._first_failed is None and store.check([self._key("first_failed")]):
            self._first_failed = int(store.get(self._key("first_failed")))
        if self._ending:
            self._read_verdict(store)
        now = self._last_ok = time.monotonic()
        for r, value in zip(self._watched, values):
            if self._last.get(r) != value:
                self._last[r], self._still_since[r] = value, now
                self._warned.discard(r)
            elif now - self._still_since[r] >= self.timeout_sec / 2 and r not in self._warned and not self._ending:
                self._warned.add(r)
                log.warning("rank %d: rank %d (%s) has not answered for %.2g min (stopped or lost?); collectives "
                            "waiting for it fail after %g min (%s)", self.rank, r, self._who(store, r),
                            (now - self._still_since[r]) / 60, self.timeout_min, CONFIG_KEY)

    def _sentinel(self) -> None:
        """Warn once when the heartbeat's store calls have not got through for half the timeout."""
        warned = False
        while not self._stop.wait(self.period):
            silent = time.monotonic() - self._last_ok
            if silent < self.timeout_sec / 2:
                warned = False
            elif not warned and not self._ending:
                warned = True
                log.warning("rank %d: %s has not answered for %.2g min (stopped or lost?); collectives fail after "
                            "%g min (%s)", self.rank, self._store_host(), silent / 60, self.timeout_min, CONFIG_KEY)

    # -- after an exception in the block -------------------------------------------------------------------

    def explain(self, err: BaseException) -> Optional[CollectiveTimeout]:
        """The CollectiveTimeout for `err`, or None to let it through: not a collective's error (then published for the
        other ranks to cite), or every rank alive and no timeout."""
        self._ending = self._explaining = True
        store = self._probe
        if not is_comm_error(err):
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            self._conclude(store, "error", [], f"{type(err).__name__}{': ' if first else ''}{first}", mark=True)
            return None
        timed_out = _is_timeout(err)
        waited = f"rank {self.rank} waited {self.timeout_min:g} min ({CONFIG_KEY}) in a collective"
        try:
            silent, gave_up, details = self._roll_call(store)
        except Exception:  # noqa: BLE001 - the store does not answer
            if self._first_failed not in (None, self.rank):     # it went away with the rank that gave up
                return CollectiveTimeout(self._after(self._first_failed))
            lost = waited if timed_out else f"rank {self.rank} lost the connection to other ranks in a collective"
            return CollectiveTimeout(f"{lost}, and {self._store_host()} does not answer (stopped or lost); "
                                     f"the run ends here")
        culprits = [r for r in silent if r not in gave_up]
        if culprits:
            kind = "named"
            what = details[0].split(": ", 1)[1] if len(culprits) == 1 else "; ".join(details)
            if timed_out:
                message = f"{waited} for {_ranks(culprits)}, which did not answer ({what}); the run ends here"
            else:
                message = (f"rank {self.rank} lost {_ranks(culprits)} in a collective: "
                           f"{'it' if len(culprits) == 1 else 'they'} did not answer ({what}); the run ends here")
        elif gave_up or self._first_failed not in (None, self.rank):
            kind, message = "after", self._after(gave_up[0] if gave_up else self._first_failed)
        elif timed_out:
            kind = "busy"
            message = (f"{waited}, but every rank is alive: one is busy elsewhere (a long evaluation, checkpoint or "
                       f"data stall) or hung; raise {CONFIG_KEY} if that work legitimately takes longer; the run "
                       f"ends here")
        else:
            return None
        self._conclude(store, kind, culprits, message, alive=self.world - len(silent))
        return CollectiveTimeout(message)

    def _mark(self, store: Any) -> None:
        """Tell the other ranks that this one gave up (before it looks around, so that they see it in time)."""
        store.set(self._key("failed", self.rank), "1")
        store.compare_set(self._key("first_failed"), "", str(self.rank))
        store.add(self._key("ending"), 1)

    def _roll_call(self, store: Any) -> tuple[list[int], list[int], list[str]]:
        """Mark this rank as failed, then watch the others' heartbeats for roll_call_sec and describe each that is still
        or gave up. TimeoutError if the store does not answer."""
        wait, others = self.answer_sec, [r for r in range(self.world) if r != self.rank]
        _timed(lambda: self._mark(store), wait)
        first = _timed(lambda: [store.add(self._key("beat", r), 0) for r in others], wait)
        time.sleep(roll_call_sec(self.timeout_sec))
        second = _timed(lambda: [store.add(self._key("beat", r), 0) for r in others], wait)
        silent = [r for r, a, b in zip(others, first, second) if a == b]
        gave_up = _timed(lambda: [r for r in silent if store.check([self._key("failed", r)])], wait)
        details = _timed(lambda: [f"rank {r}: {self._who(store, r, verdict=True)}"
                                  for r in silent if r not in gave_up][:MAX_NAMED], wait)
        _timed(lambda: self._read_verdict(store), wait)
        return silent, gave_up, details

    def _read_verdict(self, store: Any) -> None:
        """The first finding a rank published, once there is one, and a note that this rank has read it (the
        store's host waits for that after an error of its own)."""
        if self._verdict is None and store.check([self._key("verdict")]):
            self._verdict = json.loads(store.get(self._key("verdict")))
            store.set(self._key("seen", self.rank), "1")

    def _after(self, other: int) -> str:
        """The message of a rank whose collective failed after rank `other` had given up (and ended)."""
        v = self._verdict
        if v and v["rank"] != self.rank:
            if v["kind"] == "error":
                return (f"rank {self.rank}'s collective failed after rank {v['rank']} ended with an error of its "
                        f"own ({v['message']}); the run ends here")
            if v["kind"] == "named" and self.rank not in v["culprits"]:
                return f"rank {self.rank}'s collective failed after rank {v['rank']} ended the run: {v['message']}"
        return (f"rank {self.rank}'s collective failed after rank {other} had given up waiting in one (longer than "
                f"{self.timeout_min:g} min, {CONFIG_KEY}); if this rank was busy that long (evaluation, checkpoint, "
                f"data), raise {CONFIG_KEY}; the run ends here")

    def _conclude(self, store: Any, kind: str, culprits: list[int], message: str, alive: Optional[int] = None,
                  mark: bool = False) -> None:
        """Publish this rank's finding (the first one stays) and count this rank as done; the store's host then waits
        briefly for the other live ranks, as the store ends with it."""
        def publish() -> int:
            if mark:
                self._mark(store)
            store.compare_set(self._key("verdict"), "", json.dumps(
                {"rank": self.rank, "kind": kind, "culprits": culprits, "message": message}))
            return store.add(self._key("done"), 1)

        try:
            done = _timed(publish, self.answer_sec)
            if not self._hosts_store():
                return
            if alive is None:
                others = [self._key("seen", r) for r in range(self.world) if r != self.rank]
                deadline = time.monotonic() + roll_call_sec(self.timeout_sec)
                while time.monotonic() < deadline and not _timed(lambda: store.check(others), self.answer_sec):
                    time.sleep(self.period)
                return
            deadline = time.monotonic() + roll_call_sec(self.timeout_sec) + 2 * self.answer_sec
            while done < alive and time.monotonic() < deadline:
                time.sleep(self.period)
                done = _timed(lambda: store.add(self._key("done"), 0), self.answer_sec)
        except Exception:  # noqa: BLE001 - nothing more to learn or tell
            pass

    def _hosts_store(self) -> bool:
        return self.rank == 0 and self._tcp is not None \
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"

    def _who(self, store: Any, rank: int, verdict: bool = False) -> str:
        """'pid 123 on host h' for `rank` (with 'stopped: ' etc. first if `verdict`)."""
        key = self._key("who", rank)
        if not store.check([key]):
            return "never reported: it did not start the collective monitor"
        who = json.loads(store.get(key))
        where = f"pid {who['pid']} on host {who['host']}"
        if not verdict:
            return where
        return f"{describe_process(int(who['pid']), who['host'], who.get('start_ticks'))}: {where}"

    def _store_host(self) -> str:
        addr = f" at {self.store_addr}" if self.store_addr else ""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return f"the rendezvous store{addr} (torchrun's agent on rank 0's node)"
        if self.rank == 0:
            return f"the rendezvous store{addr} (hosted by this rank)"
        return f"rank 0, which hosts the rendezvous store{addr},"
