"""In-process adaptive batching with admission control: one queue and one engine thread per model.

A request is admitted at the door, before its images are decoded or its texts tokenized, only
if the work already queued ahead of it, at the speed the engine measured on its recent
batches, leaves time to answer it within its deadline; otherwise it is refused at once (503,
or 429 when the queue is full) with Retry-After. The estimate also counts the time recent
requests took from admission to the queue (reading the body, decoding, waiting for the event
loop): the engine drains the queue meanwhile, so the later of the two counts, and under a flood,
when the loop is the bottleneck, it is the preparation that decides. The deadline runs from the
request's arrival, and the answer counts as given when its callers resume on the loop after the
batch (the way back, measured like the rest). What is admitted is then served at full speed
instead of waiting for a deadline it was never going to make (Triton's queue policy, TEI's
bounded queue).

The engine thread forms each batch itself the moment the previous one returns: the requests
waiting, in the order they were admitted, up to `max_batch_size` rows and, for text,
`max_batch_tokens` padded tokens, and no more than lets the batch's earliest deadline be met.
It never waits for a batch to fill: under load the queue fills while the engine runs, and a
lone request runs at once. Forming batches on the engine thread rather than on the event
loop keeps the engine busy while the loop is parsing HTTP: under load the loop is the busier
of the two. Results go back to the loop in one hand-off per batch.

Low-priority requests (a client's `X-Priority: low`) have a lane of their own: their batches run
only while no normal request waits, each cut to about `BULK_BATCH_SECONDS` of engine time, so a
normal request arriving behind one waits for that little; and they are shed first: while normal
rows are waiting or on their way, a low-priority request is refused at once (503, `shed`), and
otherwise admitted against its deadline from its own lane's backlog.

Bulk work (`run_bulk`, behind the bulk task) has a lane of its own at the lowest priority: it
is never admitted against a deadline and its batches run only while no interactive request,
normal or low, waits. Each is cut to about `BULK_BATCH_SECONDS` of engine time, the longest an
interactive request arriving behind one waits for it, and while interactive requests keep coming the
engine rests as long as each bulk batch ran, so that bulk work takes at most half of the
engine's time and leaves the cores to the requests' own parsing and tokenizing.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from serving.errors import DeadlineExpired, DeadlineUnmet, InferenceFailed, QueueFull, Refused, Shed
from serving.metrics import ModelMetrics
from serving.text import padded_tokens_bound
from serving.tracing import RequestTrace, current_trace

Rows = TypeVar("Rows", np.ndarray, list)
# Weight of the newest batch in the running estimates: about the last ten batches count.
SMOOTHING = 0.2
# A batch's slow side: its mean engine time plus this many smoothed deviations, as TCP's
# retransmission timeout takes the round trip's (`_Speed.slow_margin`).
LATE_SPREADS = 4.0
# Those deviations fade with the seconds the engine has stood idle since its last batch, by e
# every this many (`Batcher._spread_weight`): they say how far batches strayed under the load they
# ran in, which an idle engine no longer has, and nothing measures them again while every request
# is refused on them. After one-row batches alternating 10 and 40 ms (mean 27 ms, spread 17 ms),
# an idle engine refused every later request with a 50 ms deadline, however long it waited
# (1.15 × 27 + 4 × 17 = 99 ms), and an overload test's flood of such requests got no answer in 5 s.
SPREAD_FADE_S = 1.0
# Engine time of one bulk batch, once the engine's speed is known.
BULK_BATCH_SECONDS = 0.002
# Interactive traffic is "still coming" for this long after its last request.
INTERACTIVE_QUIET_SECONDS = 0.25
# Requests handed their batch's outputs per turn of the event loop (`Batcher._deliver`).
DELIVERED_PER_TURN = 1
# The queue ahead of a request counts this much longer than its engine time at the mean pace
# (`Batcher._judge`). Judged at the mean, 2-6 % of the requests admitted to a flood of 256 clients
# with a 1 s deadline (2 cores, AVX2) waited out their deadline in the queue and were refused after
# it; counted 15 % longer, 0-2 %.
QUEUE_SLOW_SHARE = 0.15


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int  # rows per engine call
    max_latency_ms: int  # the longest a request may take from admission to its answer
    max_queue_rows: int  # rows admitted and not yet running; beyond this, 429
    max_batch_tokens: int | None = None  # text: padded tokens per engine call (serving/text.py)

    def __post_init__(self) -> None:
        if min(self.max_batch_size, self.max_latency_ms, self.max_queue_rows, self.max_batch_tokens or 1) < 1:
            raise ValueError(f"batch limits must be positive: {self}")


@dataclass
class _Pending:
    rows: np.ndarray | list
    count: int
    cost: int  # rows (images) or padded-token bound (texts): the unit the engine speed is kept in
    longest: int  # texts: tokens of the longest row, and of all rows
    tokens: int
    deadline: float
    enqueued: float
    future: asyncio.Future
    trace: RequestTrace | None = None  # the caller's, given its queue wait and its batch's time
    admitted: float = 0.0  # its request's admission (monotonic seconds): its place in the queue
    finished: float = 0.0  # when its batch returned from the engine
    # Its request's first piece: the queue-wait histogram counts requests (the saturation alert
    # divides refusals by refusals + its count), so a request split into several pieces counts once.
    first: bool = True


@dataclass
class Admission:
    """A request let in: its deadline, and the rows it reserved in the queue until it is submitted."""

    deadline: float
    reserved_rows: int
    reserved_cost: float
    admitted: float = 0.0  # monotonic seconds
    submitted: bool = False
    low: bool = False  # low priority: its own lane, reserving nothing in the normal one
    # The server's own deadline leaves out the time the request's body takes to arrive: how much
    # of it had arrived when it was admitted (None: the client's deadline, which counts it all).
    body_seconds: float | None = None

    def body_seconds_since(self) -> float:
        """The time the body took to arrive since the admission, where the server's deadline leaves it out."""
        return 0.0 if self.body_seconds is None else _body_seconds() - self.body_seconds


# The place serving/door.py reserved for the request in this context, and in which batcher.
_DOOR_PLACE: ContextVar[tuple[Batcher, Admission] | None] = ContextVar("door_place", default=None)


@dataclass
class _Speed:
    """Running estimates from the engine's own recent batches, not constants.

    A batch's engine time is kept per batch size (powers of two of its cost), each from the recent
    batches of about that size, and read between sizes along the line joining them: a batch's cost
    per unit falls as it grows (MiniLM on 2 cores: 85 µs per token in 1-row batches, 34 µs in
    64-row ones), so a single running figure is that of whatever size ran last. After a lull of
    1-row batches it made the first second of a flood look 2.5 × slower than the full batches that
    flood then ran in, and refused requests it would have answered well within their deadline
    (RELIABILITY.md)."""

    batches: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # size → (cost, seconds, spread)
    last_batch_end: float = 0.0  # monotonic seconds
    points: list[tuple[float, float, float]] = field(default_factory=list)  # `batches`' values by cost
    backlog_batch_cost: float | None = None  # batches taken from a queue they did not empty
    cost_per_row: float | None = None
    preparation_seconds: float | None = None  # from admission to the queue
    return_seconds: float = 0.0  # from a batch's end to its callers resuming on the event loop

    def observe_batch(self, seconds: float, cost: int) -> None:
        """The size's mean engine time, and its spread: how far a batch strays from the mean scaled
        to its cost, smoothed like TCP's round-trip variation. After the engine stood idle, the
        figures from before count only as much as `spread_weight` says they still hold: the first
        batch after a quiet spell mostly replaces them, or a stale mean would keep the spread up
        (every new batch straying from it) and the deadlines refused that would re-measure it."""
        ended = time.monotonic()
        held = spread_weight(ended - seconds - self.last_batch_end)
        self.last_batch_end = ended
        size = cost.bit_length()
        if (known := self.batches.get(size)) is None:
            self.batches[size] = (cost, seconds, 0.0)
        else:
            known_cost, known_seconds, spread = known
            strayed = abs(seconds - known_seconds * cost / known_cost)
            weight = max(SMOOTHING, 1 - held)
            self.batches[size] = (
                _smooth(known_cost, cost, weight),
                _smooth(known_seconds, seconds, weight),
                _smooth(held * spread, strayed),
            )
        self.points = sorted(self.batches.values())  # sizes' ranges do not overlap: in size order

    def observe_backlog_batch(self, cost: int) -> None:
        """A batch that left requests waiting: its size is what the caps and the deadlines allow a
        backlog, not what the traffic happened to offer."""
        self.backlog_batch_cost = _smooth(self.backlog_batch_cost, cost)

    def batch_seconds(self, cost: float) -> float:
        """The engine time of one batch of `cost` units (`_interpolated`); 0 before any batch ran."""
        return self._interpolated(cost, lambda point: point[1])

    def slow_margin(self, cost: float, spread_weight: float = 1.0) -> float:
        """How much longer than its mean a batch of `cost` units is taken to run where a deadline
        must hold: LATE_SPREADS spreads. Under a flood the engine shares the cores with the event
        loop, and MiniLM's batches ran 60 ms at the median and 150 ms at p99: judged on the mean,
        6–9 % of the requests let in with a 200 ms deadline were answered after it by the server's
        own clock; at 4 spreads, 1 % (RELIABILITY.md). `spread_weight`: `Batcher._spread_weight`."""
        return self._interpolated(cost, lambda point: LATE_SPREADS * spread_weight * point[2])

    def slow_side(self, cost: float, spread_weight: float) -> float:
        """`batch_seconds` plus `slow_margin`, in one interpolation (linear: the same sum): the
        engine thread asks it of every piece it takes, twice."""
        return self._interpolated(cost, lambda point: point[1] + LATE_SPREADS * spread_weight * point[2])

    def _interpolated(self, cost: float, figure: Callable[[tuple[float, float, float]], float]) -> float:
        """A batch figure for `cost` units, linear between the nearest sizes measured; beyond the
        largest in proportion to cost; below the smallest along the line through the two smallest,
        between the proportional figure and the smallest's own. In proportion there, a burst's
        first full batches promised a lone 1-row request a sixteenth of a 16-row batch's time,
        where the engine's fixed cost per batch made it two thirds, and let in deadlines it could
        not keep. 0 before any batch ran."""
        points = self.points
        if not points:
            return 0.0
        above = bisect.bisect_right(points, (cost, math.inf, math.inf))
        if above == len(points) or len(points) == 1:
            known = points[min(above, len(points) - 1)]
            return cost * figure(known) / known[0]
        low, high = points[max(above, 1) - 1], points[max(above, 1)]
        line = figure(low) + (cost - low[0]) * (figure(high) - figure(low)) / (high[0] - low[0])
        if above == 0:
            return min(figure(low), max(line, cost * figure(low) / low[0]))
        return line

    def engine_seconds(self, cost: float, batch_cost: float) -> float:
        """Engine time for `cost` units run in batches of at most `batch_cost`: full batches, then the rest."""
        if cost <= 0:
            return 0.0
        full, rest = divmod(cost, batch_cost) if cost > batch_cost else (0, cost)
        return full * self.batch_seconds(batch_cost) + self.batch_seconds(rest)

    def small_batch_cost(self) -> int | None:
        """The cost of about `BULK_BATCH_SECONDS` of engine time at the smallest batch's speed per
        unit, once the engine's speed is known. Per unit, not `batch_seconds`: with the fixed cost
        of a batch counted, one unit alone can take longer than that, and bulk work would crawl
        one row a batch."""
        if not self.points:
            return None
        cost, seconds, _ = self.points[0]
        return max(1, int(BULK_BATCH_SECONDS * cost / seconds)) if seconds else None

    def observe_request(self, rows: int, cost: int) -> None:
        self.cost_per_row = _smooth(self.cost_per_row, cost / rows)

    def observe_preparation(self, seconds: float) -> None:
        self.preparation_seconds = _smooth(self.preparation_seconds, seconds)

    def observe_return(self, seconds: float) -> None:
        self.return_seconds = _smooth(self.return_seconds, seconds)


def _smooth(current: float | None, sample: float, weight: float = SMOOTHING) -> float:
    return sample if current is None else current + weight * (sample - current)


def spread_weight(idle_s: float) -> float:
    """How much of the batches' learned spread still holds after the engine stood idle this long."""
    return math.exp(-max(0.0, idle_s) / SPREAD_FADE_S)


@dataclass
class _Queue:
    """Everything the loop and the engine thread share, guarded by `lock`."""

    pending: deque[_Pending] = field(default_factory=deque)
    low: deque[_Pending] = field(default_factory=deque)
    low_cost: int = 0
    bulk: deque[_Pending] = field(default_factory=deque)
    last_interactive: float = -math.inf
    queued_rows: int = 0
    queued_cost: int = 0
    reserved_rows: int = 0
    reserved_cost: float = 0.0
    running_cost: int = 0
    running_since: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Batcher(Generic[Rows]):
    """`await batcher.run(rows, admission)` runs `predict` on batches merged from concurrent callers."""

    def __init__(
        self,
        predict: Callable[[Rows], np.ndarray],
        *,
        limits: BatchLimits,
        metrics: ModelMetrics,
        tokens: bool = False,
    ) -> None:
        """`tokens`: rows are token-id lists and batches are capped by `max_batch_tokens` too."""
        self._predict = predict
        self.limits = limits
        self._metrics = metrics
        self._tokens = tokens
        self._queue = _Queue()
        self._work = threading.Condition(self._queue.lock)
        self._speed = _Speed(cost_per_row=None if tokens else 1.0)
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- the loop's side ---------------------------------------------------------------------

    @contextmanager
    def admit(self, rows: int, *, timeout_ms: float | None = None, low: bool = False) -> Iterator[Admission]:
        """Let a request of `rows` items in, or raise `Refused`; `timeout_ms` (the client's) can only
        shorten the server's deadline, and binds even on an idle engine, where the server's does
        not. The reservation is returned when the block exits unsubmitted. `low`: low priority
        (see above)."""
        now = time.monotonic()
        with self._queue.lock:
            self._take_door_place()
            own_cost = rows * (self._speed.cost_per_row or 1.0)
            judge = self._judge_low if low else self._judge
            refusal, deadline = judge(now, rows, own_cost, timeout_ms)
            if refusal is not None:
                raise self._refuse(refusal)
            reserved_rows, reserved_cost = (0, 0.0) if low else (rows, own_cost)
            self._queue.reserved_rows += reserved_rows
            self._queue.reserved_cost += reserved_cost
        admission = Admission(
            deadline=deadline,
            reserved_rows=reserved_rows,
            reserved_cost=reserved_cost,
            admitted=now,
            low=low,
            body_seconds=None if self._clients_deadline(timeout_ms) else _body_seconds(),
        )
        try:
            yield admission
        finally:
            if not admission.submitted:
                self._release(admission)

    def place_at_door(self, timeout_ms: float | None = None) -> Refused | AbstractContextManager[None]:
        """The refusal even the smallest request (one row) would get now, counted; else a context
        in which the request holds a row's place in the queue until its `admit` takes the place
        over. Judged from the queue alone, so serving/door.py can ask before the request has cost
        anything. The place keeps what the door saw: requests let through after this one count it
        as ahead of them, so a one-row request the door let in is never refused as over the queue's
        limit in its handler, and deadlines are judged with the requests on their way counted."""
        now = time.monotonic()
        with self._queue.lock:
            cost = self._speed.cost_per_row or 1.0
            refusal, deadline = self._judge(now, 1, cost, timeout_ms)
            if refusal is not None:
                return self._refuse(refusal)
            self._queue.reserved_rows += 1
            self._queue.reserved_cost += cost
        return self._holding(Admission(deadline=deadline, reserved_rows=1, reserved_cost=cost, admitted=now))

    @contextmanager
    def _holding(self, place: Admission) -> Iterator[None]:
        """The door's place, for `admit` to find in the request's context; returned at the end
        unless `admit` took it over."""
        token = _DOOR_PLACE.set((self, place))
        try:
            yield
        finally:
            _DOOR_PLACE.reset(token)
            if not place.submitted:
                self._release(place)

    def _take_door_place(self) -> None:
        """Turns the place the door reserved for this request in this queue, if it did, into the
        request's own: judged from here with it, it would count the request twice. Caller holds the lock."""
        held = _DOOR_PLACE.get()
        if held is not None and held[0] is self and not held[1].submitted:
            held[1].submitted = True
            self._unreserve(held[1])

    def _judge(self, now: float, rows: int, own_cost: float, timeout_ms: float | None) -> tuple[Refused | None, float]:
        """Why a request of `rows` rows (`own_cost` in engine units) cannot be let in now, if it
        cannot, and else its deadline. Caller holds the lock."""
        queue = self._queue
        waiting = queue.queued_rows + queue.reserved_rows
        if waiting and waiting + rows > self.limits.max_queue_rows:
            limit = self.limits.max_queue_rows
            message = f"the {self._metrics.endpoint} queue holds {waiting} rows, its limit is {limit}"
            return QueueFull(message, retry_after_s=self._drain_seconds(now)), now
        budget_ms = self._budget_ms(timeout_ms)
        budget_left = budget_ms / 1000 - self._spent_seconds(timeout_ms)
        # Reserved work reaches the queue about when this request does, queued work meanwhile drains.
        # The preparation time counts while others are being prepared: it was measured on admitted
        # requests, so with none in preparation it is a figure from a past crowd, which would
        # otherwise refuse everything it no longer gets to measure.
        preparing = (self._speed.preparation_seconds or 0.0) if queue.reserved_rows else 0.0
        batch_cost = self._backlog_batch_cost()
        queued = self._speed.engine_seconds(queue.queued_cost, batch_cost)
        ahead = queue.queued_cost + queue.reserved_cost + own_cost
        behind = self._speed.engine_seconds(ahead, batch_cost) - queued
        # Its own batch on its slow side, as the engine thread judges it when taking it (`_take_batch`).
        own_batch = min(ahead, batch_cost)
        slow = self._speed.slow_margin(own_batch, self._spread_weight(now))
        # The queue ahead on its slow side: its batches' own spread is no guide to how far a second
        # of them strays under a flood, where the engine shares the cores with the decoding and the
        # event loop of the requests around it (`QUEUE_SLOW_SHARE`, RELIABILITY.md).
        pace = 1 + QUEUE_SLOW_SHARE
        late = max(preparing, pace * (self._running_left(now) + queued)) + pace * behind + slow + self._returning()
        late -= budget_left
        if late <= 0:
            return None, now + budget_left
        if self._drain_seconds(now) == 0 and timeout_ms is None:
            # Too big for the server's deadline on an idle engine: refusing would not make room for
            # anyone, so it runs, as soon as it can, with no deadline to expire.
            return None, math.inf
        return self._unmet(budget_ms, late), now

    def _judge_low(
        self, now: float, rows: int, own_cost: float, timeout_ms: float | None
    ) -> tuple[Refused | None, float]:
        """`_judge` for a low-priority request: shed while normal rows wait or are on their way,
        else judged against its own lane, which runs only when the normal one is empty."""
        queue = self._queue
        waiting = queue.queued_rows + queue.reserved_rows
        if waiting:
            message = f"low priority: {waiting} rows of normal requests wait for the {self._metrics.endpoint} model"
            return Shed(message, retry_after_s=max(1.0, self._drain_seconds(now))), now
        budget_ms = self._budget_ms(timeout_ms)
        budget_left = budget_ms / 1000 - self._spent_seconds(timeout_ms)
        # Its batches as `_split` cuts them: to the small batch's cost, but never within a row.
        low_batch = max(self._speed.small_batch_cost() or own_cost, own_cost / rows)
        low_work = self._speed.engine_seconds(queue.low_cost + own_cost, low_batch)
        work = self._queued_seconds(now) + low_work + self._returning()
        late = work - budget_left
        if late <= 0:
            return None, now + budget_left
        return self._unmet(budget_ms, late, "this low-priority request "), now

    def _returning(self, *, taking: bool = False) -> float:
        """The way back an answer given now would take: what it took lately while the loop had
        other requests to serve, none when it has none (as with the preparation above, a figure
        from a crowd that has gone would refuse the short deadlines that could measure it again).
        `taking`: asked by the engine thread about the request at the queue's head, not counted as
        another. Caller holds the lock."""
        queue = self._queue
        waiting = len(queue.pending) + len(queue.low) - taking
        busy = queue.reserved_rows or queue.running_cost or waiting > 0
        return self._speed.return_seconds if busy else 0.0

    def _spread_weight(self, now: float) -> float:
        """How much of the batches' learned spread still holds: all of it while a batch runs or
        the engine has just finished one, fading by e every `SPREAD_FADE_S` it then stands idle.
        Caller holds the lock."""
        return 1.0 if self._queue.running_cost else spread_weight(now - self._speed.last_batch_end)

    def _budget_ms(self, timeout_ms: float | None) -> float:
        """The server's deadline, shortened by the client's."""
        return min(self.limits.max_latency_ms, timeout_ms or math.inf)

    def _clients_deadline(self, timeout_ms: float | None) -> bool:
        """Whether the client's deadline is the one that binds, rather than the server's."""
        return timeout_ms is not None and timeout_ms < self.limits.max_latency_ms

    def _spent_seconds(self, timeout_ms: float | None) -> float:
        """How long the request has used of its deadline: since its arrival (serving/tracing.py's
        first middleware), not its admission, which under load comes after the event loop has read
        its headers and body; less, for the server's own deadline, the time its body took to
        arrive: a phone's slow upload is not the server's time, and counted it would refuse every
        photo that takes longer to send than the deadline, on an idle server too. The client's
        deadline, on the client's clock, counts it all."""
        trace = current_trace()
        if trace is None:
            return 0.0
        spent = time.perf_counter() - trace.started
        return spent if self._clients_deadline(timeout_ms) else spent - _body_seconds()

    def _unmet(self, budget_ms: float, late: float, what: str = "") -> DeadlineUnmet:
        message = (
            f"the {self._metrics.endpoint} model cannot answer {what}within {budget_ms:.0f} ms: "
            f"its answer would take about {budget_ms + 1000 * late:.0f} ms from its arrival"
        )
        return DeadlineUnmet(message, retry_after_s=late)

    def _drain_seconds(self, now: float) -> float:
        """Engine time until everything admitted so far has run. Caller holds the lock."""
        queue = self._queue
        return self._running_left(now) + self._queued_engine_seconds(queue.queued_cost + queue.reserved_cost)

    def _queued_seconds(self, now: float) -> float:
        """Engine time until the running batch and the queue have run. Caller holds the lock."""
        return self._running_left(now) + self._queued_engine_seconds(self._queue.queued_cost)

    def _running_left(self, now: float) -> float:
        """Engine time the running batch still needs (0 before any batch was measured: admit, and
        learn from the first). Caller holds the lock."""
        queue = self._queue
        if not queue.running_cost:
            return 0.0
        ends = queue.running_since + self._speed.batch_seconds(queue.running_cost)
        return max(0.0, ends - now)

    def _queued_engine_seconds(self, cost: float) -> float:
        """Engine time for `cost` units of normal requests, in the batches a backlog runs in."""
        return self._speed.engine_seconds(cost, self._backlog_batch_cost())

    def _backlog_batch_cost(self) -> float:
        """The size of the batches a backlog runs in: as measured on recent ones, which deadlines may
        cut short, else a full batch: `max_batch_size` rows at the recent cost per row, or fewer
        where `max_batch_tokens` caps it first."""
        rows_cost = self.limits.max_batch_size * (self._speed.cost_per_row or 1.0)
        full = min(rows_cost, self.limits.max_batch_tokens or math.inf) if self._tokens else rows_cost
        return min(full, self._speed.backlog_batch_cost or full)

    def _refuse(self, error: Refused) -> Refused:
        self._metrics.refused(error.reason)
        return error

    def _release(self, admission: Admission) -> None:
        with self._queue.lock:
            self._unreserve(admission)

    def _unreserve(self, admission: Admission) -> None:
        """Caller holds the lock."""
        self._queue.reserved_rows -= admission.reserved_rows
        self._queue.reserved_cost -= admission.reserved_cost

    async def run(self, rows: Rows, admission: Admission) -> np.ndarray:
        """Outputs for `rows`, in order; rows beyond one batch's caps are split into several."""
        loop = self._start()
        now = time.monotonic()
        parts = self._split(rows, cost_cap=self._small_batch_cost() if admission.low else None)
        # A slow upload is the client's time, not the server's (`_spent_seconds`).
        uploading = admission.body_seconds_since()
        if now > admission.deadline + uploading:  # not the queue's doing: say what took the time
            raise self._refuse(
                DeadlineExpired(
                    f"the request's deadline passed before it reached the {self._metrics.endpoint} queue, "
                    f"{1000 * (now - admission.admitted):.0f} ms after its admission: its body arriving "
                    "(a client's deadline counts it), its decoding or tokenizing",
                    retry_after_s=1.0,
                )
            )
        pieces = [self._pending(part, admission.deadline + uploading, now, loop, admission.admitted) for part in parts]
        for piece in pieces[1:]:
            piece.first = False
        with self._queue.lock:
            self._unreserve(admission)
            admission.submitted = True
            self._queue.last_interactive = now
            for piece in pieces:
                if admission.low:
                    self._queue.low.append(piece)
                    self._queue.low_cost += piece.cost
                else:
                    self._enqueue(piece)
                    self._queue.queued_rows += piece.count
                    self._queue.queued_cost += piece.cost
                self._speed.observe_request(piece.count, piece.cost)
            if not admission.low:
                self._speed.observe_preparation(now - admission.admitted - uploading)
            self._work.notify()
        outputs = await _gathered(pieces)
        with self._queue.lock:
            self._speed.observe_return(time.monotonic() - max(piece.finished for piece in pieces))
        return outputs

    def _enqueue(self, piece: _Pending) -> None:
        """Into the normal queue in admission order, not arrival order: admission counted the work
        admitted before a request as ahead of it and nothing admitted after, but a request admitted
        later may be ready sooner (a shorter body, a smaller photo) and would otherwise run first,
        so that the earlier one, whose estimate left that out, missed its deadline. Caller holds
        the lock."""
        pending = self._queue.pending
        index = len(pending)
        while index and pending[index - 1].admitted > piece.admitted:
            index -= 1
        pending.insert(index, piece)

    def _small_batch_cost(self) -> int | None:
        with self._queue.lock:
            return self._speed.small_batch_cost()

    async def run_bulk(self, rows: Rows) -> np.ndarray:
        """Outputs for `rows`, in order, computed at low priority in small batches (see above)."""
        loop = self._start()
        now = time.monotonic()
        parts = self._split(rows, cost_cap=self._small_batch_cost())
        pieces = [self._pending(part, math.inf, now, loop, now) for part in parts]
        with self._queue.lock:
            self._queue.bulk.extend(pieces)
            self._work.notify()
        return await _gathered(pieces)

    def _pending(
        self, rows: Rows, deadline: float, now: float, loop: asyncio.AbstractEventLoop, admitted: float
    ) -> _Pending:
        if self._tokens:
            lengths = [len(row) for row in rows]
            longest, tokens = max(lengths), sum(lengths)
        else:
            longest = tokens = 0
        cost = self._cost(len(rows), longest, tokens)
        future = loop.create_future()
        return _Pending(rows, len(rows), cost, longest, tokens, deadline, now, future, current_trace(), admitted)

    def _split(self, rows: Rows, *, cost_cap: int | None = None) -> list[Rows]:
        """Consecutive parts that each fit one batch, and `cost_cap` if given (a single over-long
        text still runs alone)."""
        parts: list[Rows] = []
        start = longest = total = 0
        for index, row in enumerate(rows):
            length = len(row) if self._tokens else 0
            grown = (index - start + 1, max(longest, length), total + length)
            if index > start and not (self._fits(*grown) and self._cost(*grown) <= (cost_cap or math.inf)):
                parts.append(rows[start:index])
                start, longest, total = index, 0, 0
            longest, total = max(longest, length), total + length
        parts.append(rows[start:])
        return parts

    def _cost(self, rows: int, longest: int, tokens: int) -> int:
        """A batch's cost in the unit the engine's speed is kept in: padded tokens or rows."""
        return padded_tokens_bound(rows, longest, tokens) if self._tokens else rows

    def _fits(self, rows: int, longest: int, tokens: int) -> bool:
        """Whether a batch of `rows` rows (texts: of which the longest and the sum in tokens) is within the caps."""
        limit = self.limits.max_batch_tokens
        within_tokens = not self._tokens or limit is None or padded_tokens_bound(rows, longest, tokens) <= limit
        return rows <= self.limits.max_batch_size and within_tokens

    def close(self) -> None:
        """Let the engine thread end once it has run what it holds. Called when no request uses the
        batcher any more (a hot swap, serving/lifecycle.py): nothing new arrives, so this never waits."""
        with self._work:
            self._closed = True
            self._work.notify()

    def _start(self) -> asyncio.AbstractEventLoop:
        """The engine thread starts with the first request; answers go to each request's own loop."""
        if self._closed:
            raise RuntimeError(f"the {self._metrics.endpoint} batcher is closed")
        if self._thread is None:
            name = f"engine-{self._metrics.endpoint}"
            self._thread = threading.Thread(target=self._engine, name=name, daemon=True)
            self._thread.start()
        return asyncio.get_running_loop()

    def _deliver(
        self, batch: Sequence[_Pending], outputs: np.ndarray | None, error: BaseException | None, offset: int = 0
    ) -> None:
        """Hands the batch's requests their outputs (or its error), `DELIVERED_PER_TURN` per turn
        of the event loop. Each request then writes its answer in one step of about 0.25 ms
        (MiniLM, 2 cores): all 64 of a full batch in one turn held the loop for some 16 ms, in
        which no new request was read, so a refusal waited as long. The loop reads its sockets
        between turns: under a text flood its lag fell from 8-10 to 3 ms at p99 at eight a turn,
        and one a turn took a refusal's p90 at the client from 11 to 3-4 ms: closed-loop clients
        answered together come back together, and their requests then fill the turn in which a
        refusal waits (RELIABILITY.md)."""
        for piece in batch[:DELIVERED_PER_TURN]:
            if not piece.future.done():
                if error is not None:
                    piece.future.set_exception(error)
                else:
                    piece.future.set_result(outputs[offset : offset + piece.count])
            offset += piece.count
        if len(batch) > DELIVERED_PER_TURN:
            asyncio.get_running_loop().call_soon(self._deliver, batch[DELIVERED_PER_TURN:], outputs, error, offset)

    # --- the engine thread's side ------------------------------------------------------------

    def _engine(self) -> None:
        rest = 0.0  # after a bulk batch under interactive traffic: as long as it ran
        while True:
            with self._work:
                while not self._queue.pending and not self._queue.low and not self._queue.bulk:
                    if self._closed:
                        return
                    self._work.wait()
                now = time.monotonic()
                if not self._queue.pending and rest and now - self._queue.last_interactive < INTERACTIVE_QUIET_SECONDS:
                    self._work.wait(rest)  # an interactive request wakes it early
                    now = time.monotonic()
                if self._queue.pending:
                    batch, expired = self._take_batch(now)
                    bulk = False
                elif self._queue.low:
                    batch, expired = self._take_low(now)
                    bulk = False
                else:
                    batch, expired = self._take_bulk(now), []
                    bulk = True
            for piece in batch if not bulk else ():
                if piece.first:
                    self._metrics.observe_queue_wait(now - piece.enqueued)
                if piece.trace is not None:
                    piece.trace.add("queue", now - piece.enqueued)
            for piece in expired:
                error = self._refuse(
                    DeadlineExpired(
                        f"the {self._metrics.endpoint} queue ran slower than estimated: the request's deadline "
                        "passed before its turn",
                        retry_after_s=1.0,
                    )
                )
                piece.future.get_loop().call_soon_threadsafe(self._deliver, [piece], None, error)
            rest = 0.0
            if batch:
                started = time.perf_counter()
                # One loop serves a batch's requests: the service runs one per worker.
                batch[0].future.get_loop().call_soon_threadsafe(self._deliver, batch, *self._run_batch(batch))
                rest = time.perf_counter() - started if bulk else 0.0

    def _take_low(self, now: float) -> tuple[list[_Pending], list[_Pending]]:
        """The oldest live low-priority piece, already cut to one small batch, and the hopeless
        ones before it. Caller holds the lock."""
        queue = self._queue
        expired: list[_Pending] = []
        weight = self._spread_weight(now)
        while queue.low:
            piece = queue.low.popleft()
            queue.low_cost -= piece.cost
            if piece.future.cancelled():
                continue
            if now + self._speed.slow_side(piece.cost, weight) + self._returning() > piece.deadline:
                expired.append(piece)
                continue
            queue.running_cost, queue.running_since = piece.cost, now
            return [piece], expired
        return [], expired

    def _take_bulk(self, now: float) -> list[_Pending]:
        """The oldest bulk piece, already cut to one bulk batch. Caller holds the lock."""
        piece = self._queue.bulk.popleft()
        if piece.future.cancelled():
            return []
        self._queue.running_cost, self._queue.running_since = piece.cost, now
        return [piece]

    def _take_batch(self, now: float) -> tuple[list[_Pending], list[_Pending]]:
        """The waiting requests, oldest first, up to the caps and no further than the earliest
        deadline among them allows: a request is answered when its whole batch is, so a batch grown
        past that deadline would answer that request late, however soon its own rows ran. Drops the
        cancelled, and the hopeless, which would be late even alone. Caller holds the lock."""
        queue = self._queue
        batch: list[_Pending] = []
        expired: list[_Pending] = []
        rows = cost = longest = total = 0
        earliest = math.inf
        returning, weight = self._returning(taking=True), self._spread_weight(now)

        def answered(batch_cost: int) -> float:
            return now + self._speed.slow_side(batch_cost, weight) + returning

        while queue.pending:
            piece = queue.pending[0]
            hopeless = piece.future.cancelled() or answered(piece.cost) > piece.deadline
            grown_longest, grown_total = max(longest, piece.longest), total + piece.tokens
            if not hopeless and batch:
                fits = self._fits(rows + piece.count, grown_longest, grown_total)
                if not fits or answered(cost + piece.cost) > min(earliest, piece.deadline):
                    break
            queue.pending.popleft()
            queue.queued_rows -= piece.count
            queue.queued_cost -= piece.cost
            if hopeless:
                if not piece.future.cancelled():
                    expired.append(piece)
                continue
            batch.append(piece)
            earliest = min(earliest, piece.deadline)
            rows, cost, longest, total = rows + piece.count, cost + piece.cost, grown_longest, grown_total
        if batch and queue.pending:
            self._speed.observe_backlog_batch(cost)
        queue.running_cost, queue.running_since = cost, now
        return batch, expired

    def _run_batch(self, batch: list[_Pending]) -> tuple[np.ndarray | None, Exception | None]:
        started = time.perf_counter()
        outputs, error, rows = None, None, sum(piece.count for piece in batch)
        try:
            outputs = self._predict(_merge([piece.rows for piece in batch]))
        except Exception as exc:  # reaches every caller of this batch, and nothing else
            error = InferenceFailed(f"the {self._metrics.endpoint} engine failed on a batch of {rows} rows")
            error.__cause__ = exc
        elapsed = time.perf_counter() - started
        finished = time.monotonic()
        for piece in batch:
            piece.finished = finished
            if piece.trace is not None:
                piece.trace.add("infer", elapsed)
        cost = sum(piece.cost for piece in batch)
        with self._queue.lock:
            self._queue.running_cost = 0
            if error is None:
                self._speed.observe_batch(elapsed, cost)
        if error is None:
            self._metrics.observe_batch(seconds=elapsed, rows=rows)
        return outputs, error


def _body_seconds() -> float:
    """How long the current request's body has taken to arrive so far (its `read` step)."""
    trace = current_trace()
    return 0.0 if trace is None else trace.seconds.get("read", 0.0)


async def _gathered(pieces: list[_Pending]) -> np.ndarray:
    outputs = await asyncio.gather(*(piece.future for piece in pieces))
    return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)


def _merge(parts: list) -> np.ndarray | list:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return [row for part in parts for row in part]
