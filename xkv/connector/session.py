"""One connection to the xkv gateway for one connector role: the scheduler, or one worker rank.

Both roles open it the same way: connect, HELLO (``register_layout``) once per cache group,
which gives the gateway's layout id of each group and its epoch (which gateway process the slot
offsets belong to), and, on workers, map the card. Every later gateway call of the role goes
through :meth:`GatewaySession.call`, which owns the failure policy:

* an answered call resets the failure count;
* ``GatewayUnavailable`` (dead, restarted, deadline missed) counts one failure; a single slow
  answer only costs that call (the caller answers a miss, aborts, ...), but ``MAX_FAILURES``
  in a row turn the session off: the role logs its "turned off" line, and while off every call
  raises :class:`SessionOff` without a message being sent (zero hits, no saves);
* ``GatewayError`` (a refusal) costs that call only and does not count;
* after a call got no answer, every call waits at most ``probe_timeout_s`` (the lookup
  deadline) until one is answered: a dead gateway then costs the scheduler loop
  ``MAX_FAILURES`` short deadlines, not a RESERVE's ``gateway_timeout_ms`` (1 s) per request
  (the H200 run of 2026-12-01: a request right after a gateway kill waited 50 ms for its LOOKUP,
  then 1000 ms for its RESERVE, stalling every running request with it).

The state that changes (failure count, on/off, the client) sits behind one lock: the worker's
commit thread and its engine thread share one session.

Back off and re-probe, not off for good: a session that is off re-probes the gateway after
``BACKOFF_S`` (1, 2, 4, ... 30 s after each failed probe; :meth:`reattach_due`). A probe is one
PING with the short lookup deadline; if the same gateway process (epoch) answers, the session
connects afresh (HELLO again; a worker maps the card again) and is on again (the role logs its
"re-attached" line). A restarted gateway (another epoch) is used only with ``reattach: true``;
otherwise the session stays off for good (its layouts and offsets died with the old process).
The scheduler probes at its steps; a worker follows the scheduler's metadata, and does its slow
half (probe, HELLO, map and register the card) on a background thread
(``turnoff.OffPath``: :meth:`connect_fresh` there, :meth:`adopt` at a step boundary).
:meth:`detach` takes the card from a turned-off worker whose scheduler is off too (nothing can
read it any more); :meth:`unpin_step` then unregisters it one segment at a time and :meth:`let_go`
unmaps it, on that background thread.

Where later behaviours go (kept in one place on purpose): :meth:`_missed` is the only place that
decides to turn off (a back-off and re-probe policy would replace its threshold), :meth:`turn_off`
and :meth:`detach` / :meth:`release_card` the only places the card stops being used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from xkv.gateway.client import GatewayError, GatewayUnavailable

log = logging.getLogger("xkv.connector")

#: Consecutive failed gateway calls (no reply within the deadline, dead, restarted) after which a
#: process stops using the external cache (and backs off before it probes the gateway again).
MAX_FAILURES = 3
#: Seconds from turning off to the first re-probe, then after each failed probe (the last repeats).
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)

T = TypeVar("T")


class SessionOff(GatewayError):
    """The session is turned off (or never connected): no message was sent. Not a
    ``GatewayUnavailable``: it counts as no failure."""


@dataclass(frozen=True)
class LayoutSpec:
    """What HELLO tells the gateway about one cache group: its fingerprint, shards per object
    and bytes per shard (``GroupPlan.registered_bytes``)."""

    fingerprint: str
    num_shards: int
    shard_bytes: int
    #: uint32 checksum words per shard of one object (``checksums.check_words``; 0: unverified)
    check_words: int = 0


class GatewaySession:
    """The gateway connection of one role (see the module docstring).

    ``factory()`` returns a client (``xkv.gateway.client.GatewayClient`` or a test fake).
    ``on_off(reason)`` logs the role's one "turned off" line; it runs once, outside the lock.
    ``map_card``: map the card at :meth:`open` (workers). ``reattach``: also attach to a
    restarted gateway (another epoch). ``on_reattach(epoch)`` logs the role's "re-attached"
    line. ``probe_timeout_s``: the PING deadline of a re-probe. ``reattach_interval_s``: a fixed
    wait between probes instead of ``BACKOFF_S`` (tests).
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        layouts: Sequence[LayoutSpec],
        *,
        namespace: str,
        on_off: Callable[[str], None],
        map_card: bool = False,
        max_failures: int = MAX_FAILURES,
        reattach: bool = False,
        on_reattach: Callable[[int], None] | None = None,
        probe_timeout_s: float = 0.05,
        reattach_interval_s: float | None = None,
    ):
        self._factory = factory
        self._layouts = tuple(layouts)
        self._namespace = namespace
        self._on_off = on_off
        self._map_card = map_card
        self._register_card: Callable[[Any], Any] | None = None
        self.max_failures = max_failures
        self.reattach_enabled = reattach
        self._on_reattach = on_reattach
        self.reattach_interval_s = reattach_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._last_try = 0.0  # when it turned off, or last probed
        self._probes = 0  # failed probes since it turned off
        self._final = False  # the gateway restarted and reattach is off: no more probes
        self._unregister_card: Callable[[Any], None] | None = None
        self._lock = threading.Lock()
        self._client: Any = None
        self._off = False
        self._failures = 0
        self.epoch = 0
        self.layout_ids: tuple[int, ...] = ()
        self.card: Any = None  # uint8 1-D torch tensor over the mapped card (workers)

    # ------------------------------------------------------------------ state

    @property
    def check_words(self) -> tuple[int, ...]:
        """Checksum words per shard of each group's objects (HELLO's ``check_words``)."""
        return tuple(s.check_words for s in self._layouts)

    @property
    def turned_off(self) -> bool:
        with self._lock:
            return self._off

    @property
    def client(self) -> Any:
        """The raw client (None before :meth:`open` succeeded); for tests and diagnostics."""
        return self._client

    # ------------------------------------------------------------------ lifecycle

    def open(self, register_card: Callable[[Any], Any] | None = None,
             unregister_card: Callable[[Any], None] | None = None) -> bool:
        """Connect, HELLO every group, map the card if asked. False (and turned off, its line
        logged) when the gateway is dead, refuses a layout or its card cannot be mapped here.
        ``register_card(t) -> t`` makes the mapped card (a uint8 tensor) usable by the device
        (``card_pin.pin_beside_engine`` on CUDA: in segments); ``unregister_card(t, limit=None)
        -> int`` undoes it, ``limit`` segments at most (None: all), and returns how many stay
        registered (``card_pin.unpin``; :meth:`unpin_step`)."""
        self._register_card, self._unregister_card = register_card, unregister_card
        try:
            client, infos, card = self._connect()
        except GatewayError as e:
            self.turn_off(f"gateway unusable at start: {e}")
            return False
        with self._lock:
            self._client, self._failures = client, 0
            self.layout_ids = tuple(i.layout_id for i in infos)
            self.epoch = infos[0].epoch if infos else 0
            self.card = card
        return True

    def _connect(self) -> tuple[Any, list, Any]:
        """(client, HELLO replies, card tensor or None); raises GatewayError."""
        client = self._factory()
        try:
            infos = [client.register_layout(self._namespace, s.fingerprint, s.num_shards,
                                            s.shard_bytes,
                                            **({"check_words": s.check_words}
                                               if s.check_words else {}))
                     for s in self._layouts]
            card = None
            if self._map_card:
                import torch

                card = torch.frombuffer(client.map_card(), dtype=torch.uint8)
                if self._register_card is not None:
                    card = self._register_card(card)
        except GatewayError:
            _close(client)
            raise
        return client, infos, card

    def reattach_due(self) -> bool:
        """Off, not off for good, and the back-off since turning off (or the last probe) is
        over; counts as the start of a probe."""
        now = time.monotonic()
        with self._lock:
            if not self._off or self._final:
                return False
            wait = (self.reattach_interval_s if self.reattach_interval_s is not None
                    else BACKOFF_S[min(self._probes, len(BACKOFF_S) - 1)])
            if now - self._last_try < wait:
                return False
            self._last_try = now
            return True

    def reattach(self) -> bool:
        """Probe the gateway and, if it may be used, connect afresh (HELLO, map the card) and be
        on again; True when it worked. The old client and card are let go (a worker's in-flight
        copies must be done). No answer: stay off, the next probe after a longer back-off.
        Both halves on the calling thread; a worker runs :meth:`connect_fresh` on its
        background thread instead and :meth:`adopt` the result (``turnoff.OffPath``)."""
        att = self.connect_fresh()
        if att is None:
            return False
        self._let_go(self.adopt(att))
        return True

    def connect_fresh(self) -> tuple[Any, list, Any] | None:
        """The probe and connection of :meth:`reattach` without using them: (client, HELLO
        replies, card) of a gateway this session may use, or None (no answer, or a restarted
        gateway without ``reattach``). Touches nothing the engine reads: safe on any thread."""
        try:
            client = self._factory()
            epoch = _ping(client, self.probe_timeout_s)
            if epoch is not None and not self._may_use(epoch):
                _close(client)
                return None
            _close(client)
            client, infos, card = self._connect()
            if infos and not self._may_use(infos[0].epoch):
                self._let_go([client, card])
                return None
        except GatewayError as e:
            with self._lock:
                self._probes += 1
            log.debug("xkv: gateway re-probe failed: %s", e)
            return None
        return client, infos, card

    def adopt(self, att: tuple[Any, list, Any]) -> list:
        """Be on again with :meth:`connect_fresh`'s result (logs the "re-attached" line).
        Returns ``[client, card]`` of before, for the caller to let go once nothing reads it."""
        client, infos, card = att
        with self._lock:
            old = [self._client, self.card]
            self._client, self._failures, self._off, self._probes = client, 0, False, 0
            self.layout_ids = tuple(i.layout_id for i in infos)
            self.epoch = infos[0].epoch if infos else 0
            self.card = card
        if self._on_reattach is not None:
            self._on_reattach(self.epoch)
        return old

    def _may_use(self, epoch: int) -> bool:
        """The gateway that answered may be used: the same process, one never attached to, or
        a restarted one with ``reattach``. A restart without it: off for good."""
        if not self.epoch or epoch == self.epoch or self.reattach_enabled:
            return True
        with self._lock:
            self._final = True
        log.warning("xkv: the gateway restarted (epoch %d -> %d) and reattach is off: the "
                    "external cache stays off (set reattach: true to use a restarted gateway)",
                    self.epoch, epoch)
        return False

    def release_card(self) -> None:
        """Unregister and unmap the card (and close the client) of a session that is off, on
        the calling thread: for when nothing can read the card any more."""
        old = self.detach()
        if old is not None:
            self._let_go(old)

    def detach(self) -> list | None:
        """A session that is off gives up its client and card: returns ``[client, card]`` (for
        :meth:`let_go`, on any thread, once no copy can touch the card), None when it is on or
        holds neither. Loads and saves see no card from now on."""
        with self._lock:
            if not self._off or (self._client is None and self.card is None):
                return None
            old = [self._client, self.card]
            self._client, self.card = None, None
        return old

    def let_go(self, old: list) -> None:
        """Unregister ``old``'s card and close its client (what :meth:`detach` returned)."""
        self._let_go(old)

    def unpin_step(self, old: list) -> int:
        """Unregister one more segment of ``old``'s card (``[client, card]`` from :meth:`detach`;
        the card stays mapped); returns how many segments stay registered (0: :meth:`let_go`
        has no unregister left to do). The card is pinned in segments (``card_pin``) so that
        each call holds the driver's lock for one segment only."""
        card = old[1] if len(old) == 2 else None
        if card is None or self._unregister_card is None:
            return 0
        try:
            left = self._unregister_card(card, 1)
        except Exception:
            log.debug("xkv: unregistering a segment of the card failed", exc_info=True)
            return 0  # let_go tries the rest once more
        return left if isinstance(left, int) else 0

    def _let_go(self, old: list) -> None:
        """Unregister ``old = [client, card]``'s card, drop it, close the client (which unmaps
        the card once no view of it is left). Takes the list's references."""
        client, card = old
        old.clear()
        if card is not None and self._unregister_card is not None:
            try:
                self._unregister_card(card)
            except Exception:
                log.debug("xkv: unregistering the card failed", exc_info=True)
        del card  # the last view of the mapping
        if client is not None:
            _close(client)

    def close(self) -> None:
        """End of the engine: unregister and unmap the card too (an engine restarted in the
        same process must not keep the old registration pinned until garbage collection). The
        worker calls it after its loads and save copies finished."""
        with self._lock:
            old = [self._client, self.card]
            self._client, self.card = None, None
        self._let_go(old)

    def turn_off(self, reason: str) -> bool:
        """Stop using the gateway (until a re-probe succeeds); the role's line is logged. True
        when this call turned it off. The card stays mapped: loads promised before stay
        readable, each checked against its slot generation."""
        with self._lock:
            if self._off:
                return False
            self._off, self._last_try, self._probes = True, time.monotonic(), 0
        self._on_off(reason)
        return True

    # ------------------------------------------------------------------ calls

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` under the failure policy. Raises :class:`SessionOff` when off (no
        message sent), ``GatewayUnavailable`` after counting the failure (the caller answers a
        miss), ``GatewayError`` for a refusal (not counted)."""
        with self._lock:
            client = None if self._off else self._client
        if client is None:
            raise SessionOff(f"{what}: the gateway session is off")
        try:
            out = fn(client)
        except GatewayUnavailable as e:
            client.deadline_cap_s = self.probe_timeout_s  # until a call is answered
            self._missed(what, e)
            raise
        with self._lock:
            if self._failures:
                client.deadline_cap_s = None
            self._failures = 0
        return out

    def _missed(self, what: str, e: Exception) -> None:
        with self._lock:
            self._failures += 1
            n = self._failures
        if n >= self.max_failures:
            self.turn_off(f"{n} gateway calls in a row got no answer (the last: {what}: {e})")
        else:
            log.warning("xkv: %s failed (%d in a row): %s", what, n, e)

    def slot_generation(self, offset: int) -> int | None:
        """The slot's current generation (read from the mapped card, no round trip), or None
        when it cannot be read (no card, not a slot offset)."""
        client = self._client
        if client is None:
            return None
        try:
            return client.slot_generation(offset)
        except (GatewayError, ValueError):
            return None


def _close(client: Any) -> None:
    try:
        client.close()
    except Exception:  # closing a dead socket must not mask shutdown
        log.debug("xkv: gateway close failed", exc_info=True)


def _ping(client: Any, timeout_s: float) -> int | None:
    """The epoch a PING answers, or None for a client without ``ping`` (test fakes)."""
    ping = getattr(client, "ping", None)
    if ping is None:
        return None
    return int(ping(timeout_s=timeout_s).epoch)
