"""The settings machinery every specrl input shares: strict pydantic ``Section``s read from TOML,
``key.sub=value`` overrides, one-line errors, applies-only rules and commented TOML.

``specrl.config`` (the run) and the simulator (scenarios, specs) build on it, so both read,
override and report alike: ``validate`` gives one line, ``bad value for KEY: EXPECTED (got
VALUE)``, ``unknown WHAT key 'KEY'``, ``missing WHAT key 'KEY'``, joined by "; "; every problem
is a ``SettingsError`` (``errors_as`` re-raises it as the caller's type).

``load`` reads one input whole (defaults <- TOML file <- values <- overrides) and ``key_hint``
says the valid keys beside an unknown one: every command's settings are read so (``specrl.cli_util
.Shortcuts`` adds its options).

Applies-only, complete by construction: each model declares a ``Coverage`` that puts every value
field in a class: an ``AppliesOnly`` rule (set where its condition fails: refused by
``misapplied``, naming both fields), ``always`` (read in every configuration), ``checked`` (the
condition needs more than the model; the named check refuses it) or ``kept`` (ignored somewhere,
accepted there for the stated reason). ``coverage_problems`` names every field that is in no
class, and every name or condition field that is no field. ``RuledSettings`` is a command's
settings model with its rules, ``load``, ``hint`` and ``to_toml``. A leaf: imports
``specrl.errors`` only. Details: docs/internals.md.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import reduce
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Self, TypeVar

import tomlkit
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from specrl.errors import did_you_mean

M = TypeVar("M", bound=BaseModel)


class SettingsError(ValueError):
    """A bad settings input; the message is one line naming the key and the offending value."""


@contextmanager
def errors_as(kind: type[Exception]) -> Iterator[None]:
    """Re-raise a ``SettingsError`` from the block as ``kind`` (same message)."""
    try:
        yield
    except SettingsError as e:
        raise kind(str(e)) from None


class Section(BaseModel):
    """A strict table of settings (see the module's contract)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        validate_assignment=True,
        validate_default=True,
    )


# --------------------------------------------------------------------------- reading


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """The table of a TOML file; ``what`` names the file in the error (``cannot read WHAT PATH:
    ...``, ``WHAT PATH is not UTF-8 text``, ``invalid TOML in PATH: ...``)."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise SettingsError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"invalid TOML in {path}: {e}") from None


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A new table: ``base`` with ``top`` merged in, table by table (``top``'s values win)."""
    out = _copy(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if both else _copy(value)
    return out


def _copy(value: Any) -> Any:
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, dict) else value


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"learner.lr=1e-5"`` -> (["learner", "lr"], 1e-5); the value is parsed as TOML if it can."""
    key, sep, raw = item.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    if not sep or not all(parts):
        raise SettingsError(f"bad override {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def set_path(data: dict[str, Any], key: list[str], value: Any) -> None:
    """Set ``data[key[0]][key[1]]... = value`` in place, creating missing tables; a table
    ``value`` (``--set 'rollout={group_size=2}'``) is merged key by key into a table already
    there, never replacing it whole."""
    node = data
    for i, part in enumerate(key[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SettingsError(
                f"cannot set {'.'.join(key)}: {'.'.join(key[: i + 1])} is not a table"
            )
        node = child
    here = node.get(key[-1])
    both = isinstance(value, dict) and isinstance(here, dict)
    node[key[-1]] = merge(here, value) if both else value


def apply_overrides(data: dict[str, Any], items: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``key.sub=value`` item applied in order."""
    out = _copy(data)
    for item in items:
        set_path(out, *parse_override(item))
    return out


def load(
    model: type[M],
    what: str,
    path: str | Path | dict[str, Any] | None = None,
    overrides: Iterable[str] = (),
    values: dict[str, Any] | None = None,
    *,
    hint: Callable[[str], str] | None = None,
    context: dict[str, Any] | None = None,
) -> M:
    """The settings ``model`` of one input: its defaults <- a TOML file ``path`` (or its table
    as a dict) <- ``values`` (``{dotted key: value}``: a command's options) <- ``key.sub=value``
    ``overrides``, validated (``validate``: ``what`` names the input, ``cannot read WHAT config
    PATH``, ``unknown WHAT key 'KEY'``; the problems with ``values`` and ``overrides`` first)."""
    table: dict[str, Any] = {}
    if path is not None:
        table = _copy(path) if isinstance(path, dict) else read_toml(Path(path), f"{what} config")
    for key, value in (values or {}).items():
        set_path(table, key.split("."), value)
    items = list(overrides)
    data = apply_overrides(table, items)
    source = "" if path is None or isinstance(path, dict) else str(path)
    given = [*(f"{key}=" for key in values or {}), *items]
    return validate(model, data, what, hint=hint, source=source, overrides=given, context=context)


def key_hint(
    model: type[BaseModel], suggest: Callable[[str, list[str]], str]
) -> Callable[[str], str]:
    """``hint`` for ``validate``: for an unknown dotted key of ``model``, ``suggest(key, every
    key)`` (a did-you-mean: ``errors.did_you_mean``) and ``; valid keys in [TABLE]: ...`` (the
    keys of the table the unknown key is in)."""

    def hint(dotted: str) -> str:
        parent = dotted.rpartition(".")[0]
        table = model_at(model, parent.split(".")) if parent else model
        valid = [f"{parent}.{k}" if parent else k for k in (table.model_fields if table else ())]
        where = f" in [{parent}]" if parent else ""
        return f"{suggest(dotted, schema_keys(model))}; valid keys{where}: {', '.join(valid)}"

    return hint


# --------------------------------------------------------------------------- validating


def validate(
    model: type[M],
    data: dict[str, Any],
    what: str,
    *,
    hint: Callable[[str], str] | None = None,
    source: str = "",
    overrides: Iterable[str] = (),
    context: dict[str, Any] | None = None,
) -> M:
    """``model`` from ``data``, or ``SettingsError`` naming every problem in one line.

    ``what`` names the input in ``unknown WHAT key``; ``hint(key)`` adds to that message (a
    did-you-mean, the valid keys). With a ``source`` (its file), the problems with values that
    did not come from ``overrides`` (applied to ``data`` already) follow those that did, after
    one ``SOURCE: ``."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise SettingsError(_message(e.errors(), what, hint, source, list(overrides))) from None


def _message(
    errs: list[Any], what: str, hint: Callable[[str], str] | None, source: str, items: list[str]
) -> str:
    """The problems with values from override ``items`` first, then those from ``source``."""

    def from_source(err: Any) -> bool:
        return bool(source) and not any(_sets(item, dotted(err["loc"])) for item in items)

    given = [describe(err, what, hint) for err in errs if not from_source(err)]
    filed = "; ".join(describe(err, what, hint) for err in errs if from_source(err))
    return "; ".join([*given, *([f"{source}: {filed}"] if filed else [])])


def _sets(item: str, key: str) -> bool:
    """Whether override ``item`` gave the value at ``key``: the key itself, a table holding it,
    or a key below it (which made it a table)."""
    given = ".".join(p.strip() for p in item.partition("=")[0].split("."))
    above = key.startswith((f"{given}.", f"{given}["))
    return bool(key) and (key == given or above or given.startswith(f"{key}."))


def given_by(items: Iterable[str]) -> Callable[[str], bool]:
    """Whether the overrides ``items`` gave the value at a dotted key (a table override gives
    the keys it holds, not the whole table)."""
    table = apply_overrides({}, items)

    def given(key: str) -> bool:
        node: Any = table
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    return given


def describe(err: Any, what: str, hint: Callable[[str], str] | None = None) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as one phrase."""
    key = dotted(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not key:  # a rule between fields: the message names them
        return msg
    if err["type"] == "extra_forbidden":
        return f"unknown {what} key {key!r}{hint(key) if hint else ''}"
    if err["type"] == "missing":
        return f"missing {what} key {key!r}"
    msg = _EXPECTED.get(err["type"], msg)
    return f"bad value for {key}: {msg} (got {_shown(err.get('input'))})"


def dotted(loc: Iterable[Any]) -> str:
    """A pydantic location as a key: ``speculation.draft_coverage[0]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _shown(value: Any) -> str:
    """A bad value as the user wrote it (JSON, but ``inf``/``nan`` as in TOML)."""
    if isinstance(value, float) and not math.isfinite(value):
        return tomlkit.item(value).as_string()
    return json.dumps(value, default=str)


# Pydantic's type errors, said as the expected TOML type.
_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
    "dict_type": "expected a table",
    "model_type": "expected a table",
    "model_attributes_type": "expected a table",
}


# --------------------------------------------------------------------------- schema


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The section type of a field's annotation, or None for a value."""
    ok = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if ok else None


def schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key ``model`` accepts: its sections (``speculation``) and their values
    (``speculation.k``)."""
    keys: list[str] = []
    for key, info in model.model_fields.items():
        keys.append(f"{prefix}{key}")
        if (sub := submodel(info.annotation)) is not None:
            keys += schema_keys(sub, f"{prefix}{key}.")
    return keys


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted key of every value field of ``model``, its sections walked (not listed)."""
    keys: list[str] = []
    for key, info in model.model_fields.items():
        sub = submodel(info.annotation)
        keys += [f"{prefix}{key}"] if sub is None else leaf_keys(sub, f"{prefix}{key}.")
    return keys


def model_at(model: type[BaseModel], path: Iterable[str]) -> type[BaseModel] | None:
    """The section of ``model`` at a dotted path (None if the path is not a section)."""
    found: type[BaseModel] | None = model
    for part in path:
        info = found.model_fields.get(part) if found else None
        found = submodel(info.annotation) if info else None
    return found


# --------------------------------------------------------------------------- rules


class AppliesOnly(NamedTuple):
    """Field ``key`` applies only while ``test`` holds for the value of field ``other`` (of
    several fields: ``test`` gets their values as a tuple); ``needs`` says what the test asks:
    after ``other`` for one field (``"='async'"``), the whole condition for several."""

    key: str
    other: str | tuple[str, ...]
    test: Callable[[Any], bool]
    needs: str

    @property
    def others(self) -> tuple[str, ...]:
        """The fields the condition reads."""
        return (self.other,) if isinstance(self.other, str) else self.other

    @property
    def condition(self) -> str:
        """What the field needs, as a refusal says it: ``pipeline.mode='async'``."""
        return f"{self.other}{self.needs}" if isinstance(self.other, str) else self.needs

    def holds(self, model: BaseModel) -> bool:
        """Whether the field can apply in ``model``."""
        values = tuple(value_at(model, key) for key in self.others)
        return self.test(values[0] if isinstance(self.other, str) else values)


def each(
    names: Iterable[str], other: str | tuple[str, ...], test: Callable[[Any], bool], needs: str
) -> tuple[AppliesOnly, ...]:
    """The same ``AppliesOnly`` rule for each of several fields."""
    return tuple(AppliesOnly(name, other, test, needs) for name in names)


def value_at(model: BaseModel, key: str) -> Any:
    """The value at a dotted key (``pipeline.mode``)."""
    return reduce(getattr, key.split("."), model)


def was_set(model: BaseModel, key: str) -> bool:
    """Whether the field at a dotted key was given (in the data or an override, whatever its
    value: pydantic's ``model_fields_set``) rather than left at its default."""
    parent, _, name = key.rpartition(".")
    return name in (value_at(model, parent) if parent else model).model_fields_set


def set_off_default(model: BaseModel, key: str) -> bool:
    """Whether the field at a dotted key was given a value other than its default (for data
    written whole, where a default value says nothing)."""
    parent, _, name = key.rpartition(".")
    section = value_at(model, parent) if parent else model
    default = type(section).model_fields[name].get_default(call_default_factory=True)
    return was_set(model, key) and getattr(section, name) != default


def inapplicable(model: BaseModel, rules: Iterable[AppliesOnly]) -> list[AppliesOnly]:
    """The rules whose field cannot apply in ``model``."""
    return [rule for rule in rules if not rule.holds(model)]


def misapplied(
    model: BaseModel, rules: Iterable[AppliesOnly], given: Callable[[str], bool] | None = None
) -> list[str]:
    """One phrase for each field that cannot apply in ``model`` and is given (``given(key)``;
    default: ``was_set``), naming the fields of both sides."""
    given = given or (lambda key: was_set(model, key))
    return [
        f"{rule.key}={value_at(model, rule.key)!r} needs {rule.condition} (it is set, and "
        + ", ".join(f"{other} is {value_at(model, other)!r}" for other in rule.others)
        + ")"
        for rule in inapplicable(model, rules)
        if given(rule.key)
    ]


class Coverage(NamedTuple):
    """Where each value field of a model applies (see the module docstring): ``rules``;
    ``always`` (dotted keys); ``checked`` ((key, the check that refuses it where it cannot
    apply)); ``kept`` ((key, where it is ignored and why it is accepted there)). A field may
    have rules and be checked or kept besides; an ``always`` field is in no other class."""

    rules: tuple[AppliesOnly, ...]
    always: tuple[str, ...]
    checked: tuple[tuple[str, str], ...] = ()
    kept: tuple[tuple[str, str], ...] = ()

    def conditional(self) -> set[str]:
        """The fields with a rule, a check or a reason to be kept."""
        named = [*self.checked, *self.kept]
        return {rule.key for rule in self.rules} | {key for key, _ in named}


def coverage_problems(model: type[BaseModel], coverage: Coverage) -> list[str]:
    """One phrase per gap in ``coverage`` of ``model``: a field in no class, a field both always
    applying and conditional, a name or a rule's condition field that is no field of ``model``
    (an empty list: every field is classified)."""
    fields, conditional = leaf_keys(model), coverage.conditional()
    classified = {*coverage.always, *conditional}
    named = [*coverage.always, *sorted(conditional)]
    named += [other for rule in coverage.rules for other in rule.others]
    return [
        *(f"{key}: in no class" for key in fields if key not in classified),
        *(f"{key}: always and conditional" for key in coverage.always if key in conditional),
        *(f"{key}: no such field" for key in dict.fromkeys(named) if key not in fields),
    ]


def under(section: str, *names: str) -> tuple[str, ...]:
    """``section.name`` for each name (a ``Coverage``'s ``always``, section by section)."""
    return tuple(f"{section}.{name}" for name in names)


# --------------------------------------------------------------------------- writing TOML


def toml_document(model: BaseModel, skipped: dict[str, str]) -> str:
    """``model`` (whose fields are all sections) as a TOML document: its docstring, then a
    table per section (``_section_toml``; the keys of ``skipped`` only as comments)."""
    doc = tomlkit.document()
    for line in (type(model).__doc__ or "").splitlines() or [""]:
        doc.add(tomlkit.comment(" ".join(line.split())))
    for name in type(model).model_fields:
        doc.add(tomlkit.nl())
        doc.add(name, _section_toml(getattr(model, name), name, skipped))
    return tomlkit.dumps(doc)


def _section_toml(
    section: BaseModel, name: str = "", skipped: dict[str, str] | None = None
) -> tomlkit.items.Table:
    """One section as a TOML table: each field's description as a comment above it, unset
    fields and those in ``skipped`` (``"section.key"``: what they apply with) as comments,
    dict-valued fields as sub-tables after the scalars."""
    table = tomlkit.table()
    table.comment(type(section).__doc__ or "")
    dumped = section.model_dump(mode="json")
    fields_ = type(section).model_fields
    nested = [k for k in fields_ if isinstance(dumped[k], dict)]
    for key in (k for k in fields_ if k not in nested):
        if (needs := (skipped or {}).get(f"{name}.{key}")) is not None:
            table.add(tomlkit.comment(f"{key}: {fields_[key].description} (applies only "
                                      f"with {needs})"))  # fmt: skip
        elif dumped[key] is None:
            table.add(tomlkit.comment(f"{key}: {fields_[key].description} (unset)"))
        else:
            table.add(tomlkit.comment(fields_[key].description or key))
            table.add(key, dumped[key])
    for key in nested:
        sub = tomlkit.table()
        sub.comment(fields_[key].description or key)
        sub.update(dumped[key])
        table.add(key, sub)
    return table


class RuledSettings(Section):
    """A command's settings read whole (``load``: defaults <- ``--config`` <- its options <-
    ``--set``): ``WHAT`` names the command (``unknown WHAT key``, ``cannot read WHAT config``),
    ``RULES`` the fields that apply only while another holds. A field set where it cannot
    apply is refused naming both fields, except one an option gave (``context["by_option"]``:
    its keys), which the command refuses naming the option; ``check_values`` (what values must
    agree on besides the rules) runs first. ``to_toml`` reads back equal through ``load``."""

    WHAT: ClassVar[str] = ""
    RULES: ClassVar[tuple[AppliesOnly, ...]] = ()

    @model_validator(mode="after")
    def _only_what_applies(self, info: ValidationInfo) -> Self:
        self.check_values()
        by_option = (info.context or {}).get("by_option", ())
        given = lambda key: key not in by_option and was_set(self, key)  # noqa: E731
        if problems := misapplied(self, self.RULES, given):
            raise ValueError("; ".join(problems))
        return self

    def check_values(self) -> None:
        """What the values must agree on besides ``RULES`` (``ValueError``), checked first."""

    def misapplied(self) -> list[str]:
        """One phrase per field set where it cannot apply (``RULES``)."""
        return misapplied(self, self.RULES)

    def skipped(self) -> dict[str, str]:
        """{key: what it needs} for each field that cannot apply (a comment in ``to_toml``)."""
        return {rule.key: rule.condition for rule in inapplicable(self, self.RULES)}

    def to_toml(self) -> str:
        """A TOML document (each field's description as a comment above it) that ``load``
        reads back equal; a field that cannot apply is only a comment."""
        return toml_document(self, self.skipped())

    @classmethod
    def hint(cls) -> Callable[[str], str]:
        """For an unknown key: the did-you-mean and the valid keys of its table."""
        return key_hint(cls, did_you_mean)

    @classmethod
    def load(
        cls,
        path: str | Path | dict[str, Any] | None = None,
        overrides: Iterable[str] = (),
        values: dict[str, Any] | None = None,
        context: dict[str, Any] | None = None,
    ) -> Self:
        """Defaults <- TOML file (or its table) <- ``values`` ({dotted key: value}: the options
        given) <- ``section.key=value`` overrides, validated (``SettingsError``, one line)."""
        return load(cls, cls.WHAT, path, overrides, values, hint=cls.hint(), context=context)
