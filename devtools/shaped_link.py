"""The sans-IO model of one direction of a shaped link, and a frame finder for measuring.

`ShapedLink` is bandwidth, one-way delay and a bounded FIFO bottleneck buffer, with the time
passed in; devtools/link_proxy.py is the trio shell that puts two of them between real sockets.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from swarm.wire import FRAME_PREFIX

MSS = 1448
MAX_PIECE = 64 * 1024
PIECE_TIME_S = 0.002  # ~2 ms per piece: about the timer resolution, few wakeups for Python
# A sender blocked on a full bottleneck is let in again once this much room is free, not for
# every piece: a Python relay pays ~100 us per wakeup, and TCP refills in bursts anyway.
REFILL_BYTES = 8 * 1024
MIN_FLOW_WINDOW = 4 * 1024 * 1024


@dataclass(frozen=True)
class LinkShape:
    """One direction of a link.

    rate_bps: serialization rate in bits per second; 0 or None means unlimited.
    delay_s: one-way propagation delay, added after a piece leaves the bottleneck.
    buffer_bytes: bottleneck buffer; when full, the relay stops reading from the sender.
    """

    rate_bps: float | None = None
    delay_s: float = 0.0
    buffer_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.rate_bps is not None and self.rate_bps < 0:
            raise ValueError(f"rate_bps must be >= 0 (0 = unlimited), got {self.rate_bps}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be >= 1, got {self.buffer_bytes}")

    def serialization_s(self, nbytes: int) -> float:
        """Seconds `nbytes` occupy the link."""
        return nbytes * 8 / self.rate_bps if self.rate_bps else 0.0

    def piece_bytes(self) -> int:
        """Largest piece the bottleneck sends at once."""
        if not self.rate_bps:
            return MAX_PIECE
        return int(min(MAX_PIECE, max(MSS, self.rate_bps / 8 * PIECE_TIME_S)))

    def refill_bytes(self) -> int:
        """Room the bottleneck needs before the relay reads from a sender again."""
        return max(
            min(REFILL_BYTES, self.buffer_bytes // 4), min(self.piece_bytes(), self.buffer_bytes)
        )

    def window_bytes(self) -> int:
        """Bytes one flow may have inside the relay: bounds memory if a receiver stops reading."""
        if not self.rate_bps:
            return MIN_FLOW_WINDOW
        bdp = self.rate_bps / 8 * self.delay_s
        return int(max(MIN_FLOW_WINDOW, 2 * (bdp + self.buffer_bytes)))


@dataclass
class _Piece:
    flow: Hashable
    data: bytes | None  # None: the sender closed (its FIN rides the link like data)
    enqueued: float

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else 0


class ShapedLink:
    """One direction of a shaped link, sans-IO: the caller passes the time in.

    Pieces of all flows share one FIFO bottleneck and one delay line, so they leave in the order
    they were sent. Times are absolute, so late callers never make the link drift: a piece starts
    serializing when the previous one finished (or when it was sent, if the link was idle), not
    when `advance` happens to run.
    """

    def __init__(self, shape: LinkShape):
        self.shape = shape
        self._queue: deque[_Piece] = deque()
        self._queued = 0
        self._head_done: float | None = None  # fixed once the head piece starts serializing
        self._link_free = -math.inf
        self._line: deque[tuple[float, Hashable, bytes | None]] = deque()
        self._last_arrival = -math.inf

    @property
    def queued_bytes(self) -> int:
        """Bytes in the bottleneck buffer, including the piece on the wire."""
        return self._queued

    def room(self) -> int:
        """Free bytes in the bottleneck buffer."""
        return max(0, self.shape.buffer_bytes - self._queued)

    def send(self, now: float, flow: Hashable, data: bytes) -> None:
        """Put bytes of `flow` into the bottleneck; the caller keeps within `room()`."""
        step = self.shape.piece_bytes()
        for i in range(0, len(data), step):
            piece = data[i : i + step]
            self._queue.append(_Piece(flow, piece, now))
            self._queued += len(piece)

    def close(self, now: float, flow: Hashable) -> None:
        """The sender of `flow` closed; its end reaches the receiver after its last byte."""
        self._queue.append(_Piece(flow, None, now))

    def set_shape(self, now: float, shape: LinkShape) -> None:
        """Change the shape from `now` on; a piece already on the wire keeps its old timing."""
        self._serialize(now)
        self.shape = shape

    def advance(self, now: float) -> list[tuple[Hashable, bytes | None]]:
        """Pieces that have reached the receiver by `now`, in order; None marks a flow's end."""
        self._serialize(now)
        out = []
        while self._line and self._line[0][0] <= now:
            _, flow, data = self._line.popleft()
            out.append((flow, data))
        return out

    def next_arrival(self) -> float:
        """When the next piece reaches its receiver, if nothing more is sent; inf if none."""
        if self._line:
            return self._line[0][0]
        if self._queue:
            return max(self._head_finish() + self.shape.delay_s, self._last_arrival)
        return math.inf

    def when_room(self, nbytes: int) -> float:
        """When `room()` reaches `nbytes`, if nothing more is sent; inf if it never will."""
        need = nbytes - self.room()
        if need <= 0:
            return -math.inf
        freed = 0
        for t, piece in self._finish_times():
            freed += piece.size
            if freed >= need:
                return t
        return math.inf

    def drained_at(self) -> float:
        """When the bottleneck will have sent all it holds, if nothing more is sent."""
        return max((t for t, _ in self._finish_times()), default=-math.inf)

    def _finish_times(self) -> Iterator[tuple[float, _Piece]]:
        """When each queued piece will have left the bottleneck, in order, if nothing more is
        sent."""
        t = 0.0
        for i, piece in enumerate(self._queue):
            if i == 0:
                t = self._head_finish()
            else:
                t = max(t, piece.enqueued) + self.shape.serialization_s(piece.size)
            yield t, piece

    def _head_finish(self) -> float:
        if self._head_done is None:
            head = self._queue[0]
            start = max(self._link_free, head.enqueued)
            self._head_done = start + self.shape.serialization_s(head.size)
        return self._head_done

    def _serialize(self, now: float) -> None:
        while self._queue and self._head_finish() <= now:
            piece = self._queue.popleft()
            self._link_free = self._head_done
            self._head_done = None
            self._queued -= piece.size
            # a delay that shrank mid-run must not let a piece overtake the one before it
            arrival = max(self._link_free + self.shape.delay_s, self._last_arrival)
            self._last_arrival = arrival
            self._line.append((arrival, piece.flow, piece.data))


class FrameScanner:
    """Finds where frames start in one flow's bytes: swarm.wire's length prefix, then that many
    bytes. Only for measuring; the relay forwards any bytes."""

    def __init__(self) -> None:
        self._need = 0  # body bytes of the current frame still to come
        self._prefix = b""  # a prefix split across reads

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        """(offset in `data` where a frame's prefix began, 0 if in an earlier read; the frame's
        size with its prefix) for each frame whose prefix completes in `data`."""
        out = []
        pos = 0
        while pos < len(data):
            if self._need:
                take = min(self._need, len(data) - pos)
                pos += take
                self._need -= take
                continue
            start = max(0, pos - len(self._prefix))
            take = min(FRAME_PREFIX.size - len(self._prefix), len(data) - pos)
            self._prefix += data[pos : pos + take]
            pos += take
            if len(self._prefix) == FRAME_PREFIX.size:
                (self._need,) = FRAME_PREFIX.unpack(self._prefix)
                self._prefix = b""
                out.append((start, self._need + FRAME_PREFIX.size))
        return out
