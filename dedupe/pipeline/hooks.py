"""The app's hooks by pipeline stage (claimed, handled, completed), run in registration order."""

from __future__ import annotations

from dedupe.app import STAGES, App, Hook
from dedupe.claims.records import Fence
from dedupe.message import Message


class Hooks:
    """The app's hooks by stage; a stage without hooks costs nothing."""

    def __init__(self, app: App) -> None:
        self._hooks: dict[str, list[Hook]] = {stage: [] for stage in STAGES}
        for stages, hook in app.hooks:
            for stage in stages:
                self._hooks[stage].append(hook)

    def any(self, stage: str) -> bool:
        return bool(self._hooks[stage])

    async def __call__(self, stage: str, message: Message, fence: Fence) -> None:
        for hook in self._hooks[stage]:
            await hook(stage, message, fence.scope, fence.key)


__all__ = ["Hooks"]
