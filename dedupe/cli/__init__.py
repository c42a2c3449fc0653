"""The `dedupe-worker` command: read the options and the environment, run the command.

The parser lives in parser.py; each command in its own module (run, receive, status, admin).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence

from dedupe.cli.options import (
    UsageError,
    load_app,
    logger,
    loop_factory,
    make_publisher,
    make_transport,
    misspelt_variables,
    read_environment,
    settings_from,
)
from dedupe.cli.parser import build_parser
from dedupe.errors import DedupeError, StoreError
from dedupe.observability import logs


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        read_environment(parser, args, os.environ)
        settings = settings_from(args)
    except UsageError as exc:
        parser.exit(2, f"dedupe-worker: error: {exc}\n")
    logs.configure(settings.log_level, settings.log_format)
    for warning in misspelt_variables(parser, os.environ):
        logger.warning("%s", warning)
    try:
        with (
            contextlib.suppress(KeyboardInterrupt),
            asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner,
        ):
            return int(runner.run(args.handler(args, settings)))
        return 130
    except (DedupeError, StoreError) as exc:
        print(f"dedupe-worker: error: {exc}", file=sys.stderr)
        return 1


__all__ = ["UsageError", "build_parser", "load_app", "main", "make_publisher", "make_transport"]
