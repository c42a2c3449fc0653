"""The crash point between a `ctx.step`'s call and its record ("stepped").

A step's function is an external call; its result is recorded under the claim as soon as it
returns, so a later attempt gets the record instead of calling again. A worker that dies after
the call and before the record calls again on the retry: that call must carry the same
idempotency key (one derived from `ctx.key`), or the other side does it twice.

The pipeline has no hook there, so a TestRun watches its app's steps itself: for the run's
length each handler that takes a ctx is registered wrapped (the same function, whose ctx's
steps are watched when a TestRun's worker runs it; outside one it is the handler as written),
and the originals are put back once the app's last run ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from dedupe.app import App, Handler
from dedupe.context import Context, Effects


class StepWatcher(Protocol):
    """What a TestRun does once a step's function returned, before its record: nothing, or
    kill the worker (a crash point), or hold it (a stall)."""

    async def stepped(self, ctx: Context, name: str) -> None: ...


# The watcher of the calling code's run (a TestRun), read when a wrapped handler starts.
WatcherOf = Callable[[], StepWatcher | None]


class _WatchedEffects:
    """A run's effects whose steps tell the watcher when their function has returned."""

    def __init__(self, inner: Effects, ctx: Context, watcher: StepWatcher) -> None:
        self._inner = inner
        self._ctx = ctx
        self._watcher = watcher

    async def publish(
        self,
        channel: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        return await self._inner.publish(channel, body, key=key, headers=headers)

    async def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async def called(*a: Any, **kw: Any) -> Any:
            # As RunEffects calls it: a coroutine function awaited, any other in a thread.
            if inspect.iscoroutinefunction(fn):
                value = await fn(*a, **kw)
            else:
                value = await asyncio.to_thread(fn, *a, **kw)
                if inspect.isawaitable(value):
                    value = await value
            await self._watcher.stepped(self._ctx, name)
            return value

        return await self._inner.step(name, called, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _watched(fn: Callable[..., Awaitable[Any]], watcher_of: WatcherOf) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def handler(payload: Any, ctx: Context) -> Any:
        watcher = watcher_of()
        if watcher is not None and ctx.effects is not None:
            ctx.effects = _WatchedEffects(ctx.effects, ctx, watcher)
        return await fn(payload, ctx)

    return handler


class _Installed:
    def __init__(self, originals: dict[str, Handler]) -> None:
        self.originals = originals
        self.runs = 0


_installed: weakref.WeakKeyDictionary[App, _Installed] = weakref.WeakKeyDictionary()


def watch_steps(app: App, watcher_of: WatcherOf) -> None:
    """Register the app's ctx-taking handlers wrapped (once per app, however many runs)."""
    installed = _installed.get(app)
    if installed is None:
        originals = {name: h for name, h in app.handlers.items() if h.takes_context}
        for name, handler in originals.items():
            app.handlers[name] = dataclasses.replace(handler, fn=_watched(handler.fn, watcher_of))
        installed = _installed[app] = _Installed(originals)
    installed.runs += 1


def unwatch_steps(app: App) -> None:
    """One run of the app ended; the last one puts its handlers back as registered."""
    installed = _installed.get(app)
    if installed is None:
        return
    installed.runs -= 1
    if installed.runs > 0:
        return
    del _installed[app]
    for name, original in installed.originals.items():
        if name in app.handlers:
            app.handlers[name] = original


__all__ = ["StepWatcher", "unwatch_steps", "watch_steps"]
