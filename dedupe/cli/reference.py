"""The configuration reference (docs/configuration.md) generated from the code: Settings,
the parser, the commands' source, and the Kafka transport's URL options (from its plugin).

    python -m dedupe.cli.reference > tables.md

A test checks that docs/configuration.md holds exactly these tables, so a new setting,
option, Kafka option or environment variable cannot be left out of the docs.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
from collections.abc import Callable

from dedupe.cli.options import FromEnvironment, commands
from dedupe.plugins import server, transport_plugin
from dedupe.registry import installed_schemes
from dedupe.settings import Settings

# What each setting means; a test fails when a Settings field has no line here.
MEANING = {
    "database_url": "PostgreSQL holding the claims (and the handlers' ctx.db)",
    "broker_url": "`amqp://user:pass@host:port[,host2:port...]/vhost` (RabbitMQ; "
    "`?queue_type=quorum`, see below), `kafka://host:port[,host2:port...]` (Kafka), "
    "or a URL of another installed transport ([transports.md](transports.md))",
    "concurrency": "handlers running at once per worker",
    "prefetch": "unacknowledged deliveries held (RabbitMQ prefetch, Kafka batch); "
    "default 8 x concurrency",
    "shutdown_timeout_s": "grace period for in-flight messages on SIGTERM/SIGINT",
    "connect_timeout_s": "how long to keep retrying PostgreSQL and the broker at start",
    "gc_interval_s": (
        "period of the workers' clean-up of expired claims and sent outbox rows; "
        "0 = off (schedule `dedupe-worker gc`)"
    ),
    "park_after_s": (
        "a retry delay or backoff at least this long goes through the broker (the key given "
        "back, a delay queue or retry topic carries the message); a shorter one waits in the "
        "worker with its lease"
    ),
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
    "status_token": "required to release keys from the status page, and to view it on the "
    "receiver's port from another host; unset = loopback clients only (environment only: a "
    "secret does not belong on a command line)",
}


# Variables read by the libraries underneath, not by dedupe-worker's own settings; a unit test
# fails when the code reads an environment variable that is neither here nor a setting.
OTHER_VARIABLES = {
    "PGSSLMODE": (
        "commands that connect to PostgreSQL",
        "TLS to PostgreSQL when the URL has no `sslmode` (read by asyncpg). Set, it also "
        "turns off the shortcut that connects to a loopback PostgreSQL without TLS",
    ),
    "PGTARGETSESSIONATTRS": (
        "commands that connect to PostgreSQL",
        "which host of a URL listing several to keep (read by asyncpg). Unset, and with no "
        "`target_session_attrs` in the URL, a URL with several hosts asks for `read-write` "
        "(the primary; [operations](operations.md#running-against-clusters))",
    ),
    "PGPASSWORD, PGPASSFILE, PGSSLROOTCERT, PGSSLCERT, PGSSLKEY, ...": (
        "commands that connect to PostgreSQL",
        "the other libpq variables asyncpg reads, for what the URL leaves out (a password, "
        "TLS certificates)",
    ),
    "OTEL_*": (
        "run",
        "read by the OpenTelemetry SDK, not by dedupe-worker: they apply once the SDK is "
        "configured, e.g. under `opentelemetry-instrument` (`OTEL_SERVICE_NAME`, "
        "`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_TRACES_SAMPLER`, ...); see "
        "[observability.md](observability.md#traces)",
    ),
    "PYTHONPATH": (
        "run, receive",
        "where MODULE of MODULE:APP is looked for, after the current directory",
    ),
}

ALL_COMMANDS = "all commands"


def _flags(parser: argparse.ArgumentParser) -> dict[str, dict[str, set[str]]]:
    """{setting: {flag: {commands}}} for every option whose dest is a setting."""
    found: dict[str, dict[str, set[str]]] = {}
    for command, p in commands(parser):
        for action in p._actions:
            if action.dest in Settings.model_fields and action.option_strings:
                flag = max(action.option_strings, key=len)
                found.setdefault(action.dest, {}).setdefault(flag, set()).add(command)
    return found


def _commands(names: set[str], every: set[str]) -> str:
    tops = {c.split()[0] for c in names}
    return ALL_COMMANDS if tops >= every else ", ".join(sorted(tops))


def settings_read_by() -> dict[str, set[str]]:
    """{setting: {commands}}: the commands whose code reads each setting, found in the source
    of main() and of each command's handler, following the functions of dedupe.cli it uses."""
    from dedupe.cli import build_parser, main

    everywhere = _settings_read_in(main)
    found: dict[str, set[str]] = {name: set() for name in Settings.model_fields}
    for command, parser in commands(build_parser()):
        handler = parser.get_default("handler")
        if handler is None or " " in command:
            continue
        for name in everywhere | _settings_read_in(handler):
            found[name].add(command)
    return found


def _settings_read_in(root: Callable[..., object]) -> set[str]:
    """The settings read as `settings.<name>` in root and the dedupe functions (and classes'
    methods) it calls, and in what those load by entry point: a server, a transport plugin's
    method."""
    names: set[str] = set()
    seen: set[Callable[..., object]] = set()
    queue = [root]
    while queue:
        function = queue.pop()
        if function in seen:
            continue
        seen.add(function)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError):  # generated (a dataclass's __init__): nothing read there
            continue
        known = getattr(function, "__globals__", {})
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "settings"
            ):
                names.add(node.attr)
            elif isinstance(node, ast.Call):
                queue.extend(_called(node, known))
        if known.get("transport_plugin") is transport_plugin:
            # plugin = transport_plugin(url); plugin.transport(settings): the plugin methods
            # this function calls, of every installed plugin, may read the settings given.
            called = {
                node.func.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            }
            queue.extend(_plugin_methods(called & {"transport", "publisher", "admin"}))
    for name in list(names):  # a property such as effective_prefetch reads other settings
        prop = getattr(Settings, name, None)
        if isinstance(prop, property) and prop.fget is not None:
            source = textwrap.dedent(inspect.getsource(prop.fget))
            names.update(
                node.attr
                for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            )
    return names & set(Settings.model_fields)


def _called(call: ast.Call, known: dict[str, object]) -> list[Callable[..., object]]:
    """What a call runs that the audit follows: a dedupe function, or a dedupe class's methods
    (dedupe.Worker(settings=...)); `server("name")`'s server; `transport_plugin(url).method(...)`'s
    method, of every installed plugin."""
    func = call.func
    if isinstance(func, ast.Name):
        called = known.get(func.id)
        if called is server and call.args and isinstance(call.args[0], ast.Constant):
            return [server(str(call.args[0].value))]
        if not getattr(called, "__module__", "").startswith("dedupe"):
            return []
        if inspect.isfunction(called):
            return [called]
        if inspect.isclass(called):
            return [f for f in vars(called).values() if inspect.isfunction(f)]
    elif (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and known.get(func.value.func.id) is transport_plugin
    ):
        plugins = [transport_plugin(f"{scheme}://") for scheme in installed_schemes()]
        return [getattr(plugin, func.attr) for plugin in plugins]
    return []


def _plugin_methods(names: set[str]) -> list[Callable[..., object]]:
    plugins = [transport_plugin(f"{scheme}://") for scheme in installed_schemes()]
    return [getattr(plugin, name) for plugin in plugins for name in sorted(names)]


def table() -> str:
    """The settings: variable, options, the commands that read it, default, meaning."""
    from dedupe.cli import build_parser

    parser = build_parser()
    every = {c for c, p in commands(parser) if c and " " not in c}
    flags = _flags(parser)
    read_by = settings_read_by()
    lines = [
        "| environment variable | option (commands) | read by | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = "host:pid" if name == "worker_name" else "computed"
        elif field.default is None:
            default = "unset"
        else:
            default = f"`{field.default}`"
        options = "; ".join(
            f"`{flag}` ({_commands(offered, every)})"
            for flag, offered in sorted(flags.get(name, {}).items())
        )
        lines.append(
            f"| `DEDUPE_{name.upper()}` | {options or '-'} | "
            f"{_commands(read_by[name], every) if read_by[name] else '-'} | {default} | "
            f"{MEANING[name]} |"
        )
    return "\n".join(lines) + "\n"


def command_options() -> str:
    """Per command, the options that are not settings, with their DEDUPE_<COMMAND>_<OPTION>."""
    from dedupe.cli import build_parser

    lines = [
        "| command | option | environment variable | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for command, parser in commands(build_parser()):
        for action in parser._actions:
            if action.dest in Settings.model_fields or isinstance(
                action, argparse._HelpAction | argparse._SubParsersAction
            ):
                continue
            name = (
                ", ".join(f"`{o}`" for o in action.option_strings)
                or f"`{action.metavar or action.dest}`"
            )
            meaning = (action.help or "").replace("|", "\\|")
            marker = action.default
            if isinstance(marker, FromEnvironment):
                variable = f"`{marker.variable}`"
                meaning = meaning.removesuffix(f" [{marker.variable}; {marker.shown}]")
                default = marker.shown
            else:
                variable = "-"
                default = "-" if action.default in (None, False) else str(action.default)
            lines.append(f"| `{command}` | {name} | {variable} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def kafka_options() -> str:
    """The options of a kafka:// broker URL, as the Kafka transport's plugin lists them."""
    return url_options("kafka://")


def rabbitmq_options() -> str:
    """The options of an amqp:// broker URL, as the RabbitMQ transport's plugin lists them."""
    return url_options("amqp://")


def url_options(url: str) -> str:
    """The options the transport of `url`'s scheme reads from its URL, as a table."""
    lines = [
        "| URL option | type | default | `run`'s default | meaning |",
        "|---|---|---|---|---|",
    ]
    for option in transport_plugin(url).url_options():
        lines.append(
            f"| `{option.name}` | {option.type} | `{option.default}` | {option.run_default} | "
            f"{option.meaning} |"
        )
    return "\n".join(lines) + "\n"


def other_variables() -> str:
    """The variables dedupe-worker honours besides its own DEDUPE_* ones."""
    lines = ["| environment variable | read by | meaning |", "|---|---|---|"]
    for name, (read_by, meaning) in OTHER_VARIABLES.items():
        variables = ", ".join(f"`{v}`" if v != "..." else v for v in name.split(", "))
        lines.append(f"| {variables} | {read_by} | {meaning} |")
    return "\n".join(lines) + "\n"


def reference() -> str:
    """The tables, as docs/configuration.md holds them between its markers."""
    sections = [table(), f"### Options of each command\n\n{command_options()}"]
    sections.append(
        "### Kafka options in the broker URL\n\n"
        "`--broker 'kafka://host:9092,host2:9092?group_id=billing&partitions=8'`: every "
        "command that talks to Kafka reads them; `run` gives four of them defaults of its "
        f"own.\n\n{kafka_options()}"
    )
    sections.append(
        "### RabbitMQ options in the broker URL\n\n"
        "`--broker 'amqp://user:pass@rabbit1:5672,rabbit2:5672,rabbit3:5672/vhost?"
        "queue_type=quorum'`: the nodes are tried in the order written, on the first connect and "
        "on every reconnect, by the worker, the receiver, the outbox relay and the operator "
        "commands alike; the rest of the query (`heartbeat=`, ...) is the AMQP client's."
        f"\n\n{rabbitmq_options()}"
    )
    sections.append(f"### Other environment variables\n\n{other_variables()}")
    return "\n".join(sections)


if __name__ == "__main__":  # pragma: no cover
    print(reference(), end="")
