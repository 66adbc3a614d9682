"""What every ``specrl`` command shares: the one-line error exit, and how settings are read.

``fail(message, code=2)`` prints ``error: <message>`` to stderr and exits (never a traceback);
``refuse_unless_applies`` fails on an option given where it cannot apply; ``Shortcuts`` is the
one way a command reads its settings (a ``specrl.settings`` model): defaults <- ``--config
FILE`` <- its options, each the same as one key (an option and a ``--set`` of the same key in
one command line are refused) <- ``--set key=value``, every problem one ``error:`` line;
``named_as_keys`` declares options named as their keys; ``Given`` holds the settings and names
each key as it was given; ``os_errors_in_one_line``
ends a command's unhandled OSError in one line. ``OneLineErrors`` (the
root group's class) prints every usage error as one ``error: ... (see specrl CMD --help)`` line,
exit 2, and an OSError of a full disk, a quota, a permission or a read-only file system that a
command did not handle as one ``error: no space left on device: PATH`` line
(``fsutil.disk_problem``), exit 2; ``parse_device`` resolves ``--device`` or fails in one
line; ``write_or_print`` writes a command's results, or prints them and fails in one line. Only
CLI modules import this; at import time it imports nothing from specrl. Details:
docs/internals.md.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import typer
from typer.core import TyperGroup

# typer 0.29 parses with its own vendored copy of click (the private ``typer._click``), whose
# exceptions are not click's; a typer that uses click itself raises click's. pyproject.toml keeps
# typer within 0.29.x, and tests/test_cli_one_line.py fails if this stops converting.
try:
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # no vendored click: typer parses with click
    from click.exceptions import NoArgsIsHelpError, UsageError


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def os_errors_in_one_line(command: Callable, hint: str = "") -> Callable:
    """``command`` with an OSError (an unwritable output, a full disk) ending in one ``error:``
    line (``hint`` appended) and exit 2 instead of a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except OSError as e:
            where = f": {e.filename}" if e.filename else ""
            fail(f"{e.strerror or e}{where}{hint}")

    return run


def given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` (its parameter name) was given on the command line, whatever
    its value (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def refuse_unless_applies(ctx: typer.Context, names: list[str], applies: bool, needs: str) -> None:
    """The one rule for options that apply only with others: an option of ``names`` given
    where it cannot apply (``applies`` False) is one line naming it and ``needs``."""
    if applies:
        return
    for name in names:
        if given(ctx, name):
            fail(f"{_option(ctx, name)} applies only with {needs}")


def _option(ctx: typer.Context, name: str) -> str:
    param = next((p for p in ctx.command.params if p.name == name), None)
    return param.opts[0] if param is not None and param.opts else name


class OneLineUsageError(UsageError):
    """A usage error that shows itself as one ``error:`` line."""

    def show(self, file: Any = None) -> None:
        message = " ".join(self.format_message().split())
        hint = f" (see {self.ctx.command_path} --help)" if self.ctx is not None else ""
        typer.echo(f"error: {message}{hint}", err=True)


def _one_line(e: UsageError) -> UsageError:
    if isinstance(e, NoArgsIsHelpError | OneLineUsageError):
        return e
    return OneLineUsageError(e.format_message(), e.ctx)


class OneLineErrors(TyperGroup):
    """A command group whose usage errors (its own and its subcommands') are one line."""

    def make_context(self, *args: Any, **kwargs: Any) -> typer.Context:
        try:
            return super().make_context(*args, **kwargs)
        except UsageError as e:
            raise _one_line(e) from None

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as e:
            raise _one_line(e) from None
        except OSError as e:
            from specrl.fsutil import disk_problem

            if (line := disk_problem(e)) is None:
                raise
            fail(line)


def write_or_print(path: Path, text: str) -> None:
    """Write ``text`` (a command's results) to ``path`` atomically, its parents created; if that
    fails, print it to stdout so that nothing is lost, then one ``error:`` line."""
    from specrl.fsutil import atomic_write

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)
    except OSError as e:
        typer.echo(text)
        fail(f"cannot write --json {path}: {e.strerror or e} (the results are printed above)")


def parse_device(name: str):
    """``--device`` resolved (one ``error:`` line when it cannot be had here)."""
    from specrl.models.device import DeviceError, resolve_device

    try:
        return resolve_device(name)
    except DeviceError as e:
        fail(str(e))


# --------------------------------------------------------------------------- settings

M = TypeVar("M")


class Shortcuts(Generic[M]):
    """A command's settings ``model`` and its options kept beside ``--config``/``--set``, each
    the same as ``--set KEY=value`` of one key.

    ``what`` names the command (``unknown WHAT key 'KEY'``, ``cannot read WHAT config PATH``);
    ``options`` maps each such option's parameter name to (its declaration, as typer takes it:
    ``"--chat-template/--no-chat-template"``, its key); ``hint`` says more of an unknown key
    (default: the did-you-mean and the valid keys of its table); ``rules`` are the model's
    ``settings.AppliesOnly`` rules, refused in the options' words for a key an option gave (the
    model's validator refuses the others; it gets ``context={"by_option": keys}``)."""

    def __init__(
        self,
        model: type[M],
        what: str,
        options: dict[str, tuple[str, str]],
        hint: Callable[[str], str] | None = None,
        rules: Iterable[Any] = (),
    ) -> None:
        self.model, self.what, self.options = model, what, dict(options)
        self.hint, self.rules = hint, tuple(rules)

    def key(self, name: str) -> str:
        """The key option ``name`` (its parameter name) sets."""
        return self.options[name][1]

    def flag(self, key: str, value: Any = True) -> str:
        """The option of ``key`` as a message names it (``--no-chat-template`` for False), or
        the key if no option sets it."""
        decl = next((d for d, k in self.options.values() if k == key), None)
        if decl is None:
            return key
        on, _, off = decl.partition("/")
        return off if off and value is False else on

    def option(self, name: str, help: str, **kwargs: Any) -> Any:
        """The ``typer.Option`` of shortcut ``name``: ``help``, the default (from the model)
        and ``the same as --set KEY=...``; leave its default None (None: not given)."""
        from specrl import settings

        decl, key = self.options[name]
        default = settings.value_at(self.model(), key)
        none = default is None or default == [] or "default" in help
        shown = "" if none else f" (default {json.dumps(default)})"
        return typer.Option(decl, help=f"{help}{shown}; the same as --set {key}=...", **kwargs)

    def config_option(self, more: str = "") -> Any:
        """The ``--config FILE`` option (``more``: what else it may be)."""
        sections = ", ".join(getattr(self.model, "model_fields", {}))
        return typer.Option("--config", help=f"TOML settings (sections {sections}){more}; "
                            "the options below and --set apply over it")  # fmt: skip

    def set_option(self, examples: str) -> Any:
        """The repeatable ``--set section.key=value`` option (``examples``: a few of them)."""
        return typer.Option(
            "--set",
            help="override: section.key=value, the value TOML (repeatable; over --config and "
            f"the options), e.g. {examples}",
        )

    def read(self, ctx: typer.Context, check: Callable[[Given[M]], None] | None = None) -> Given[M]:
        """The settings of the command line in ``ctx`` (its ``config`` and ``sets``
        parameters and each shortcut given, not None), or one ``error:`` line. ``check`` (the
        command's own checks of values) runs before the rules are refused for keys that
        options gave, so that a bad value is named as such first."""
        return self.read_parsed(ctx, dict, check)

    def read_parsed(
        self,
        ctx: typer.Context,
        parse: Callable[[dict[str, Any]], dict[str, Any]],
        check: Callable[[Given[M]], None] | None = None,
    ) -> Given[M]:
        """``read``, the options given ({parameter name: value}) passed through ``parse`` first:
        the command's own reading of an option's text (a comma list as a list), one ``error:``
        line naming the option for a bad one."""
        from specrl.settings import SettingsError

        params = ctx.params
        named = {n: params[n] for n in self.options if params.get(n) not in (None, [], ())}
        named = parse(named)
        try:
            out = self.load(params.get("config"), list(params.get("sets") or ()), named)
        except SettingsError as e:
            fail(str(e))
        if check is not None:
            check(out)
        if problem := out.misapplied(self.rules):
            fail(problem)
        return out

    def load(self, config: Path | None, sets: list[str], named: dict[str, Any]) -> Given[M]:
        """The settings: defaults <- the file ``config`` <- the options given, ``named``
        ({parameter name: value}) <- ``sets``; ``SettingsError`` (one line) for a bad value,
        an unknown key, an option and a ``--set`` of the same key, a rule broken by a key
        ``--config`` or ``--set`` gave (``Given.misapplied`` says those the options gave)."""
        from specrl import errors, settings

        by_set = settings.given_by(sets)
        values, by_option = {}, {}
        for name, value in named.items():
            key = self.key(name)
            by_option[key] = self.flag(key, value)
            if by_set(key):
                raise settings.SettingsError(
                    f"{by_option[key]} and --set {key} both set {key}: give one"
                )
            values[key] = _plain(value)
        hint = self.hint or settings.key_hint(self.model, errors.did_you_mean)
        cfg = settings.load(self.model, self.what, config, sets, values, hint=hint,
                            context={"by_option": frozenset(by_option)})  # fmt: skip
        return Given(cfg, by_option, {k: self.flag(k) for _, k in self.options.values()})


def named_as_keys(section: str, *names: str) -> dict[str, tuple[str, str]]:
    """Shortcut options named as their keys (``Shortcuts``' ``options``): ``--max-kv-tokens``
    (parameter ``max_kv_tokens``) for ``SECTION.max_kv_tokens``, for each of ``names``."""
    return {name: (f"--{name.replace('_', '-')}", f"{section}.{name}") for name in names}


def _plain(value: Any) -> Any:
    """An option's value as a settings value: paths as strings (lists of them too)."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


@dataclass(frozen=True)
class Given(Generic[M]):
    """The settings ``cfg`` a command runs with; ``by_option``: {key: the option that gave
    it}; ``options``: {key: its option} for every key an option sets."""

    cfg: M
    by_option: dict[str, str]
    options: dict[str, str]

    def given(self, key: str) -> bool:
        """Whether ``key`` was given (by an option, ``--set`` or ``--config``)."""
        from specrl.settings import was_set

        return key in self.by_option or was_set(self.cfg, key)

    def name(self, key: str) -> str:
        """How a message names ``key``: the option that gave it; the key, if ``--set`` or
        ``--config`` did; else its option (the key if it has none)."""
        if key in self.by_option:
            return self.by_option[key]
        return key if self.given(key) else self.options.get(key, key)

    def condition(self, rule: Any) -> str:
        """What an ``AppliesOnly`` rule needs, its field named by its option where it has one."""
        if isinstance(rule.other, str):
            return f"{self.options.get(rule.other, rule.other)}{rule.needs}"
        return rule.condition

    def misapplied(self, rules: Iterable[Any]) -> str | None:
        """The first ``AppliesOnly`` rule of ``rules`` broken by a key an option gave, in the
        options' words (``--num-spec-tokens applies only with --spec other than 'none'``)."""
        from specrl.settings import inapplicable

        for rule in inapplicable(self.cfg, rules):
            if rule.key in self.by_option:
                return f"{self.by_option[rule.key]} applies only with {self.condition(rule)}"
        return None

    def refuse_unless_applies(self, keys: list[str], applies: bool, needs: str) -> None:
        """``refuse_unless_applies`` for settings: a key of ``keys`` given (by any means) where
        it cannot apply (``applies`` False) is one line naming it (``name``) and ``needs``."""
        if applies:
            return
        for key in keys:
            if self.given(key):
                fail(f"{self.name(key)} applies only with {needs}")
