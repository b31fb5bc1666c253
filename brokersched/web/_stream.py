"""The live event stream (Server-Sent Events): every client has a bounded queue that the
scheduler's listeners fill; a client too slow to keep up is cut off (its browser reconnects and
reloads the state), and a client that goes away is removed.

A client's place is taken when its request is answered (``open()``), not when its stream first
runs: a burst of requests all answered before any stream starts would otherwise all pass the
cap. The place is given back when the response ends, however it ends."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Literal

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .._events import Event, RunEvent, SkipEvent, StartEvent
from .._json import shown_error
from .._scheduler import Job, Scheduler

__all__ = ["EventHub", "EventStreamResponse", "StreamEvent", "event_json"]

#: The events the stream carries (``event:`` of each message).
StreamEvent = Literal["skip", "start", "complete", "fail"]

QUEUE_SIZE = 256
SKIPS_KEPT = 200  # per job: the timeline shows why this instance skipped a slot
MAX_CLIENTS = 100  # streams open at once: each holds a connection and a queue
KEEPALIVE_S = 15.0  # a comment line now and then: a proxy keeps the stream, a dead peer shows
RETRY_MS = 2000


def event_json(
    kind: StreamEvent, event: Event, instance_id: str, job: Job | None
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "type": kind,
        "job": event.job,
        "slot_ms": event.slot_ms,
        "instance_id": instance_id,
    }
    if isinstance(event, SkipEvent):
        data["reason"] = event.reason
        data["detail"] = shown_error(event.detail, job) if event.detail else None
    elif isinstance(event, StartEvent | RunEvent):
        data.update(run_id=event.run_id, reason=event.reason, attempt=event.attempt)
        if isinstance(event, RunEvent):
            data.update(
                outcome=event.outcome,
                error=shown_error(event.error, job) if event.error else None,
                duration_ms=event.duration_ms,
            )
    return data


class _Client:
    __slots__ = ("cut", "loop", "queue")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(QUEUE_SIZE)
        self.cut = False

    def put(self, message: str) -> None:
        if self.cut:
            return
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.end()  # too slow: the stream ends, the browser reconnects and reloads

    def end(self) -> None:
        self.cut = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class EventHub:
    """Listens to one scheduler's ``skip``/``start``/``complete``/``fail`` events and fans them
    out to the connected clients."""

    def __init__(self, scheduler: Scheduler[Any]) -> None:
        self._scheduler = scheduler
        self._instance_id = scheduler.instance_id
        self._clients: set[_Client] = set()
        self._skips: dict[str, deque[SkipEvent]] = {}
        scheduler.on("skip", self._on_skip)
        scheduler.on("start", lambda event: self._publish("start", event))
        scheduler.on("complete", lambda event: self._publish("complete", event))
        scheduler.on("fail", lambda event: self._publish("fail", event))

    @property
    def clients(self) -> int:
        return len(self._clients)

    @property
    def full(self) -> bool:
        return len(self._clients) >= MAX_CLIENTS

    def skips(self, job: str) -> list[SkipEvent]:
        """The latest slots this instance skipped, oldest first."""
        return list(self._skips.get(job, ()))

    def _on_skip(self, event: SkipEvent) -> None:
        self._skips.setdefault(event.job, deque(maxlen=SKIPS_KEPT)).append(event)
        self._publish("skip", event)

    def close(self) -> None:
        """End every stream (the server is stopping)."""
        for client in self._clients:
            client.end()

    def _publish(self, kind: StreamEvent, event: Event) -> None:
        job = self._scheduler.get(event.job)
        data = json.dumps(event_json(kind, event, self._instance_id, job), separators=(",", ":"))
        message = f"event: {kind}\ndata: {data}\n\n"
        for client in list(self._clients):
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if client.loop is running:
                client.put(message)
            else:  # the scheduler runs in another thread's loop (start_in_thread)
                client.loop.call_soon_threadsafe(client.put, message)

    def open(self) -> _Client | None:
        """A place for one more client, or ``None`` when every place is taken."""
        if self.full:
            return None
        client = _Client()
        self._clients.add(client)
        return client

    def release(self, client: _Client) -> None:
        self._clients.discard(client)

    async def stream(self, client: _Client | None = None) -> AsyncIterator[str]:
        """One client's stream, until it goes away (the server cancels this generator) or
        falls too far behind. Without ``client``, a place is taken now (regardless of the
        cap) and given back at the end."""
        if client is None:
            client = _Client()
            self._clients.add(client)
        try:
            yield f"retry: {RETRY_MS}\n: connected\n\n"
            while True:
                try:
                    message = await asyncio.wait_for(client.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if message is None:
                    return
                yield message
        finally:
            self.release(client)


class EventStreamResponse(StreamingResponse):
    """A client's stream that gives its place back when the response ends, also when it ends
    before the stream ever ran (the client left at once)."""

    def __init__(self, hub: EventHub, client: _Client, headers: dict[str, str]) -> None:
        super().__init__(hub.stream(client), media_type="text/event-stream", headers=headers)
        self._hub, self._client = hub, client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._hub.release(self._client)
