"""The configuration reference (docs/configuration.md) generated from Settings and the parser.

    python -m dedupe.cli.reference > table.md

A test checks that docs/configuration.md holds exactly this table, so a new setting or
option cannot be left out of the docs.
"""

from __future__ import annotations

import argparse

from ..settings import Settings

# What each setting means; a test fails when a Settings field has no line here.
MEANING = {
    "database_url": "PostgreSQL holding the claims (and the handlers' ctx.db)",
    "broker_url": "`amqp://user:pass@host:port/vhost` (RabbitMQ) or `kafka://host:port` (Kafka)",
    "concurrency": "handlers running at once per worker",
    "prefetch": "unacknowledged deliveries held (RabbitMQ prefetch, Kafka batch); "
    "default 2 x concurrency",
    "shutdown_timeout_s": "grace period for in-flight messages on SIGTERM/SIGINT",
    "connect_timeout_s": "how long to keep retrying PostgreSQL and the broker at start",
    "gc_interval_s": "period of the workers' clean-up of expired claims; 0 = off",
    "stats_interval_s": "period of the worker's progress log line; 0 = off",
    "worker_name": "owner written on claims (shows in `claims list` and the status page)",
    "log_level": "DEBUG, INFO, WARNING or ERROR (DEBUG adds one line per message)",
    "log_format": "`text` for people, `json` for machines (one object per line)",
    "event_loop": "`auto` (uvloop when installed), `uvloop` or `asyncio`",
    "receiver_host": "address the webhook receiver listens on",
    "receiver_port": "port of the webhook receiver",
    "metrics_host": "address of the worker's /metrics endpoint",
    "metrics_port": "serve Prometheus metrics on this port; 0 = off",
    "metrics_interval_s": "period of the claims-table gauges (oldest in-progress, clean-up lag)",
    "status_host": "address of `status --serve`",
    "status_port": "port of `status --serve`",
    "status_token": "required to release keys from the status page; unset = loopback clients "
    "only (environment only: a secret does not belong on a command line)",
}


def _flags(parser: argparse.ArgumentParser) -> dict[str, dict[str, set[str]]]:
    """{setting: {flag: {commands}}} for every option whose dest is a setting."""
    found: dict[str, dict[str, set[str]]] = {}

    def walk(p: argparse.ArgumentParser, command: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif action.dest in Settings.model_fields and action.option_strings:
                flag = max(action.option_strings, key=len)
                found.setdefault(action.dest, {}).setdefault(flag, set()).add(command)

    walk(parser, "")
    return found


def _commands(commands: set[str]) -> str:
    tops = sorted({c.split()[0] for c in commands})
    return "all commands" if len(tops) >= 6 else ", ".join(tops)


def table() -> str:
    """The markdown table: variable, options, default, meaning."""
    from . import build_parser

    flags = _flags(build_parser())
    lines = [
        "| environment variable | option (commands) | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = "host:pid" if name == "worker_name" else "computed"
        elif field.default is None:
            default = "unset"
        else:
            default = f"`{field.default}`"
        options = "; ".join(
            f"`{flag}` ({_commands(commands)})"
            for flag, commands in sorted(flags.get(name, {}).items())
        )
        lines.append(
            f"| `DEDUPE_{name.upper()}` | {options or '-'} | {default} | {MEANING[name]} |"
        )
    return "\n".join(lines) + "\n"


def command_options() -> str:
    """Per command, the options that are not settings (they have no environment variable)."""
    from . import build_parser

    lines = ["| command | option | meaning |", "|---|---|---|"]

    def walk(p: argparse.ArgumentParser, command: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif action.dest not in Settings.model_fields and action.dest != "help":
                name = (
                    ", ".join(f"`{o}`" for o in action.option_strings)
                    or f"`{action.metavar or action.dest}`"
                )
                meaning = (action.help or "").replace("|", "\\|")
                if not meaning and action.choices:
                    meaning = "one of " + ", ".join(map(str, action.choices))
                if not meaning and action.dest == "key":
                    meaning = "the idempotency key"
                if not meaning and action.dest == "channel":
                    meaning = "the channel whose `<channel>.dlq` is read"
                if action.default not in (None, False) and not meaning.endswith(")"):
                    meaning += f" (default {action.default})"
                lines.append(f"| `{command}` | {name} | {meaning} |")

    walk(build_parser(), "")
    return "\n".join(lines) + "\n"


def reference() -> str:
    """Both tables, as docs/configuration.md holds them between its markers."""
    return f"{table()}\n### Options of each command\n\n{command_options()}"


if __name__ == "__main__":  # pragma: no cover
    print(reference(), end="")
