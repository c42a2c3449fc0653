"""What every command shares: options, settings, loading the app, picking the transport
(through its plugin, dedupe.plugins)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import importlib
import logging
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pydantic

from dedupe.app import App
from dedupe.errors import ConfigurationError, DedupeError
from dedupe.plugins import transport_plugin
from dedupe.settings import Settings, invalid_settings
from dedupe.transport import Publisher, Transport

logger = logging.getLogger("dedupe.cli")
T = TypeVar("T")


class UsageError(DedupeError):
    """The command line asks for something that cannot be done."""


def add_common(parser: argparse.ArgumentParser, *, broker: bool) -> None:
    """The options of every command: database, broker (where it needs one), logging."""
    parser.add_argument(
        "--database",
        dest="database_url",
        metavar="URL",
        help="PostgreSQL URL holding the claims [DEDUPE_DATABASE_URL; default: local dedupe db]",
    )
    if broker:
        parser.add_argument(
            "--broker",
            dest="broker_url",
            metavar="URL",
            help="amqp://user:pass@host:port/vhost (RabbitMQ) or kafka://host:port "
            "[DEDUPE_BROKER_URL; default: local RabbitMQ]",
        )
    parser.add_argument(
        "--log-level",
        dest="log_level",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR [DEDUPE_LOG_LEVEL; default: INFO]",
    )
    parser.add_argument(
        "--log-format",
        dest="log_format",
        choices=["text", "json"],
        help="text for people, json (one object per line) for machines "
        "[DEDUPE_LOG_FORMAT; default: text]",
    )
    parser.add_argument(
        "--event-loop",
        dest="event_loop",
        choices=["auto", "uvloop", "asyncio"],
        help="auto: uvloop when it is installed (pip install 'dedupe-worker[uvloop]'; "
        "1.1-1.2x the messages per second of a worker in our benchmarks), else asyncio's own "
        "[DEDUPE_EVENT_LOOP; default: auto]",
    )


# -- options of one command, each with its DEDUPE_<COMMAND>_<OPTION> variable ---------------

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


@dataclasses.dataclass(frozen=True, eq=False)
class FromEnvironment:
    """The default of an option left off the command line: its variable, else `fallback`."""

    variable: str
    fallback: Any
    shown: str  # the default as the help and the docs show it


# The receive command's variables are DEDUPE_RECEIVER_*, like its host and port settings.
VARIABLE_PREFIX = {"receive": "receiver"}


def option_variable(prog: str, flag: str) -> str:
    """`dedupe-worker claims list` and `--older-than-s` -> DEDUPE_CLAIMS_LIST_OLDER_THAN_S."""
    words = [VARIABLE_PREFIX.get(word, word) for word in prog.split()[1:]]
    return "DEDUPE_" + "_".join([*words, flag.lstrip("-")]).upper().replace("-", "_")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text}")
    return value


def add_option(
    parser: argparse.ArgumentParser,
    *flags: str,
    help: str,
    default: Any = None,
    shown: str | None = None,
    **kwargs: Any,
) -> None:
    """Add an option of this command alone; left off the command line, it reads the variable
    DEDUPE_<COMMAND>_<OPTION> (read_environment), which its help names with its default."""
    variable = option_variable(parser.prog, flags[0])
    if shown is None:
        shown = str(default).lower() if isinstance(default, bool) else str(default)
    parser.add_argument(
        *flags,
        default=FromEnvironment(variable, default, shown),
        help=f"{help} [{variable}; {shown}]",
        **kwargs,
    )


def commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser with its name (`""` for the top, `claims list`, ...)."""

    def walk(
        p: argparse.ArgumentParser, name: str
    ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        yield name, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word, sub in action.choices.items():
                    yield from walk(sub, f"{name} {word}".strip())

    return walk(parser, "")


def variable_of(action: argparse.Action) -> str | None:
    """The environment variable an option reads, or None (--yes, --help, positionals)."""
    if isinstance(action.default, FromEnvironment):
        return action.default.variable
    if action.dest in Settings.model_fields and action.option_strings:
        return f"DEDUPE_{action.dest.upper()}"
    return None


def read_environment(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> None:
    """Give each command option left off the command line its variable's value, else its
    default (settings read theirs in settings_from). An empty variable counts as unset."""
    for _, command in commands(parser):
        for action in command._actions:
            # Still the marker: not given on the command line (and this command's option, not
            # another command's with the same dest).
            if getattr(args, action.dest, None) is action.default:
                marker = action.default
                if isinstance(marker, FromEnvironment):
                    raw = environ.get(marker.variable, "")
                    setattr(args, action.dest, _from_text(action, marker, raw))


def misspelt_variables(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """A warning per DEDUPE_* variable no setting or option reads that is one slip away from
    one that does (DEDUPE_CONCURENCY). Others are left alone: the prefix is not ours alone."""
    known = {f"DEDUPE_{name.upper()}" for name in Settings.model_fields}
    for _, command in commands(parser):
        for action in command._actions:
            if isinstance(action.default, FromEnvironment):
                known.add(action.default.variable)
    warnings = []
    for name in sorted(environ):
        if name.startswith("DEDUPE_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.9)
            if close:
                warnings.append(
                    f"the environment variable {name} is not one dedupe-worker reads (ignored) "
                    f"— did you mean {close[0]}?"
                )
    return warnings


def _from_text(action: argparse.Action, marker: FromEnvironment, raw: str) -> Any:
    if not raw:
        return marker.fallback
    if action.nargs == 0:  # a flag such as --json
        word = raw.strip().lower()
        if word in TRUE_WORDS | FALSE_WORDS:
            return action.const if word in TRUE_WORDS else marker.fallback
        raise UsageError(f"{marker.variable}={raw!r}: expected true or false (1/0, yes/no, on/off)")
    convert: Callable[[str], Any] = action.type if callable(action.type) else str
    try:
        value = convert(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        kinds: dict[object, str] = {
            int: "a whole number",
            float: "a number",
            positive_int: "a whole number of at least 1",
            positive_float: "a number above 0",
        }
        kind = kinds.get(convert, "a valid value")
        raise UsageError(f"{marker.variable}={raw!r}: expected {kind}") from exc
    if action.choices is not None and value not in action.choices:
        raise UsageError(
            f"{marker.variable}={raw!r}: expected one of {', '.join(map(str, action.choices))}"
        )
    return value


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by the options given on the command line."""
    overrides = {
        name: value
        for name, value in vars(args).items()
        if name in Settings.model_fields and value is not None
    }
    try:
        return Settings(**overrides)
    except pydantic.ValidationError as exc:
        raise UsageError(invalid_settings(exc)) from exc


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to run a command on: uvloop where asked for or, on auto, installed."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise UsageError(
                "--event-loop uvloop: uvloop is not installed; pip install 'dedupe-worker[uvloop]'"
            ) from exc
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def load_app(target: str, *, need: str = "handlers") -> App:
    """Import `module:attribute` and check it is an App with handlers (or webhooks)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"{target!r}: expected MODULE:APP, for example handlers.payments:app")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like python -m: the current directory is importable
    module = _import_app_module(module_name)
    app = getattr(module, attribute, None)
    if not isinstance(app, App):
        raise UsageError(
            f"{module_name!r} has no dedupe App named {attribute!r}; define one with "
            "app = dedupe.App('name')"
        )
    if need == "webhooks":
        if not app.webhooks:
            raise UsageError(
                f"app {app.name!r} declares no webhook sources; add one with app.webhook(...)"
            )
        return app
    if not app.handlers:
        raise UsageError(f"app {app.name!r} has no handlers; register one with @app.handler(...)")
    return app


def _import_app_module(name: str) -> ModuleType:
    """Import the app's module; an error in it becomes one line: where, what, what to do."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or name
        if name == missing or name.startswith(f"{missing}."):
            raise UsageError(
                f"cannot import module {name!r} ({exc}); run from your project's root or "
                "add it to PYTHONPATH"
            ) from exc
        raise UsageError(
            f"{_where(exc)}: module {name!r} imports {missing!r}, which is not installed in "
            f"this Python ({sys.executable}): install it there, or correct the import if "
            "it is a module of your project"
        ) from exc
    except SyntaxError as exc:  # IndentationError and TabError too
        where = f"{_shown(exc.filename)}:{exc.lineno}" if exc.filename else _where(exc)
        raise UsageError(
            f"{where}: {type(exc).__name__}: {exc.msg} (while importing {name!r}); fix that "
            "line and start the command again"
        ) from exc
    except DedupeError as exc:  # a registration error: its message says what to do
        raise ConfigurationError(f"{_where(exc)}: {exc}") from exc
    except Exception as exc:
        logger.debug("importing %s failed", name, exc_info=exc)
        raise UsageError(
            f"{_where(exc)}: importing {name!r} raised {type(exc).__name__}: {exc}; fix the "
            "module (--log-level DEBUG prints the traceback)"
        ) from exc


def _where(exc: BaseException) -> str:
    """`file:line` of the innermost frame of the user's code in exc's traceback."""
    library = [
        Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")
    ]
    library.append(Path(__file__).resolve().parent.parent)  # dedupe itself
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if not any(path.is_relative_to(root) for root in library):
            return f"{_shown(frame.filename)}:{frame.lineno}"
    return f"{_shown(frames[-1].filename)}:{frames[-1].lineno}" if frames else "<unknown>"


def _shown(filename: str) -> str:
    """A path relative to the current directory when it is below it (shorter to read)."""
    path = Path(filename).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else filename


def make_transport(settings: Settings, *, app_name: str | None = None) -> Transport:
    """The transport of the broker URL's scheme, from its plugin (Kafka names its group after
    the app)."""
    return transport_plugin(settings.broker_url).transport(settings, app_name=app_name)


def make_publisher(settings: Settings) -> Publisher:
    """The confirming publisher of the broker URL's scheme (for the webhook receiver)."""
    return transport_plugin(settings.broker_url).publisher(settings)


def confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise UsageError(f"{question} -- not a terminal: pass --yes to confirm")
    return input(f"{question} [y/N] ").strip().lower() in {"y", "yes"}


def print_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    table = [[cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col), *(len(r[i]) for r in table)]) for i, col in enumerate(columns)]
    print("  ".join(col.upper().ljust(w) for col, w in zip(columns, widths, strict=True)))
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if hasattr(value, "isoformat"):
        return str(value.isoformat(timespec="seconds"))
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
