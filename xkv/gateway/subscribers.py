"""A cap on the connections of the KV-events PUB socket: memory per subscriber times subscribers.

Why: a PUB socket queues up to its high-water mark (``events.SUBSCRIBER_HWM`` batches, each at
most about ``events.MAX_BATCH_BYTES``) for every subscriber that does not read, so one such
subscriber costs a bounded amount, but ZMQ takes any number of them (issue 27 item 7: no cap).
ZMQ has no connection limit, so :class:`SubscriberCap` watches the socket's monitor
(``EVENT_ACCEPTED`` carries the accepted TCP socket's fd, ``EVENT_DISCONNECTED`` its end): past
``max_subscribers`` connections it shuts the new connection down (``shutdown(2)`` on a duplicate
of the fd; ZMQ's I/O thread then sees the end of the stream and drops the connection, logging
``EVENT_DISCONNECTED``). A refused subscriber's ZMQ reconnects after its reconnect interval and
is refused again while the others stay; each refusal is counted, and logged at most once per
``LOG_INTERVAL_S`` (the line counts the refusals it stands for).

Before shutting a connection down, the fd is checked to be a TCP socket whose local port is the
publisher's (a reused fd of another socket of the gateway is never touched). Bounded work: at
most ``EVENTS_PER_PASS`` monitor events per loop pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("xkv.gateway")

#: Connections to the KV-events PUB socket at most (routers; each may cost
#: ``SUBSCRIBER_HWM * MAX_BATCH_BYTES`` of gateway memory when it does not read).
MAX_SUBSCRIBERS = 32
#: Seconds between two log lines about refused subscribers.
LOG_INTERVAL_S = 10.0
#: Monitor events handled per loop pass at most.
EVENTS_PER_PASS = 256


class SubscriberCap:
    """Counts the connections of ``sock`` (a bound TCP PUB socket on ``port``) and refuses those
    past ``max_subscribers``. Single-threaded: the gateway loop calls :meth:`poll` once per
    pass. ``subscribers``: connected now; ``refused``: connections shut down so far."""

    def __init__(self, sock: zmq.Socket, port: int, max_subscribers: int = MAX_SUBSCRIBERS):
        if max_subscribers < 1:
            raise ValueError(f"max_subscribers={max_subscribers}: expected >= 1")
        self.port = port
        self._sock = sock
        self.max_subscribers = max_subscribers
        self._mon = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._fds: set[int] = set()
        self.refused = 0
        self._next_log = 0.0

    @property
    def subscribers(self) -> int:
        return len(self._fds)

    def poll(self) -> None:
        """Handle the monitor events that arrived (``EVENTS_PER_PASS`` at most)."""
        if self._mon.closed:
            return
        for _ in range(EVENTS_PER_PASS):
            try:
                ev = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                self._fds.discard(fd)
            elif ev["event"] == zmq.EVENT_ACCEPTED:
                if len(self._fds) < self.max_subscribers:
                    self._fds.add(fd)
                elif self._shut(fd):
                    self.refused += 1
                    self._log()

    def _shut(self, fd: int) -> bool:
        """Shut down the TCP connection on ``fd`` if it is one of the publisher's."""
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False  # closed meanwhile: nothing to refuse
        try:
            if s.type != socket.SOCK_STREAM or s.getsockname()[1] != self.port:
                return False
            s.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                s.close()  # the duplicate only: ZMQ closes its own fd

    def _log(self) -> None:
        now = time.monotonic()
        if now < self._next_log:
            return
        log.warning("KV events: refused a subscriber: %d connected, the cap is %d "
                    "(events.MAX_SUBSCRIBERS; a subscriber that does not read holds up to "
                    "SUBSCRIBER_HWM batches of gateway memory); %d refused so far (at most one "
                    "line per %.0f s)", len(self._fds), self.max_subscribers, self.refused,
                    LOG_INTERVAL_S)
        self._next_log = now + LOG_INTERVAL_S

    def close(self) -> None:
        """Stop watching (before ``sock`` is closed; the monitor socket is in its context, which
        cannot terminate while it is open). Idempotent."""
        if self._mon.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._mon.close(linger=0)
