"""The processing pipeline: a batch of deliveries claimed, run and concluded into one settlement
each: the processor, the runs of a claim of ours, group commit, hooks, and what observers are
told."""

from __future__ import annotations

from dedupe.pipeline.observers import Observer, Observers
from dedupe.pipeline.processor import Processor
from dedupe.pipeline.stats import Stats

__all__ = ["Observer", "Observers", "Processor", "Stats"]
