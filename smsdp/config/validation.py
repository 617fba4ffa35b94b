"""The pydantic layer: config models whose every failure is a ``ConfigError``.

Pydantic's own errors (types, bounds, literals) are translated into
``ConfigProblem``s located at the field as the user wrote it, with the field's
default as the value that would work; unknown keys get a did-you-mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, model_validator
from pydantic_core import PydanticCustomError, PydanticUndefined

from smsdp.config.errors import NO_VALUE, ConfigError, ConfigProblem, did_you_mean, problems_of


def _problems_from_validation_error(exc: ValidationError, model: type[BaseModel]) -> list[ConfigProblem]:
    """Translate pydantic's errors into ConfigProblems, one per error.

    Rules raised by our own validators arrive as ``value_error`` wrapping a
    ConfigError whose paths are relative to the model that raised it; they are
    re-rooted at pydantic's ``loc``. Pydantic's own errors (types, bounds,
    literals) get the field's default as the value that would work.
    """
    problems: list[ConfigProblem] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        cause = (error.get("ctx") or {}).get("error")
        if error["type"] == "value_error" and isinstance(cause, ConfigError):
            problems.extend(p.prefixed(loc) for p in problems_of(cause))
            continue
        value = error.get("input", NO_VALUE)
        if isinstance(value, Mapping) and error["type"] != "model_type":
            value = NO_VALUE
        problems.append(ConfigProblem(loc, _describe_pydantic_error(error, model, loc), value))
    return problems


def _describe_pydantic_error(error: Mapping[str, Any], model: type[BaseModel], loc: tuple) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    rule = f"is invalid: {message}"
    default = _default_at(model, loc)
    if error["type"] == "model_type":
        rule += "; write a dict"
    elif error["type"] == "bool_or_whole":
        pass  # its message says what the key takes
    elif isinstance(default, bool):
        rule += "; use True or False"
    elif default is not NO_VALUE and default is not None:
        rule += f"; use e.g. {default!r} (the default)"
    return rule


def _default_at(model: type[BaseModel] | None, loc: tuple) -> Any:
    """The default of the field at ``loc`` (by name or alias), or NO_VALUE."""
    for index, part in enumerate(loc):
        field = _find_field(model, part)
        if field is None:
            return NO_VALUE
        if index == len(loc) - 1:
            if field.default is PydanticUndefined:
                return NO_VALUE
            return field.default
        model = _model_class(field.annotation)
    return NO_VALUE


def _find_field(model: Any, name: Any):
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    for field_name, field in model.model_fields.items():
        aliases = getattr(field.validation_alias, "choices", ())
        if name == field_name or name in aliases:
            return field
    return None


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside ``annotation`` (``Model`` or ``Model | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def plain(obj: Any) -> Any:
    """Copy nested Mappings into dicts, so pydantic sees what the user wrote."""
    if isinstance(obj, BaseModel):
        return obj
    if isinstance(obj, Mapping):
        return {key: plain(value) for key, value in obj.items()}
    return obj


def _whole_number(value: Any) -> Any:
    """Accept 5e8 for an int field (as the SageMaker docs write it), reject 1.5 and True."""
    if isinstance(value, bool):
        raise PydanticCustomError("whole_number", "expected a whole number, got a bool")
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise PydanticCustomError("whole_number", "expected a whole number, got {value}", {"value": value})
    return value


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("number", "expected a number, got a bool")
    return value


WholeNumber = Annotated[int, BeforeValidator(_whole_number), Strict(), Field(le=2**63 - 1)]
"""An int that may be written as a float with no fraction (``5e8``); never a bool or str.

At most 2**63 - 1: every rank must be able to read back the JSON the client wrote."""

Number = Annotated[float, BeforeValidator(_not_bool), Strict(), Field(allow_inf_nan=False)]
"""A finite float or int; never a bool or str."""


class ConfigModel(BaseModel):
    """Base of every config model: strict keys, frozen, ConfigError on failure.

    Pydantic's ``extra="forbid"`` would say "extra inputs are not permitted";
    we check keys ourselves first so an unknown key gets a did-you-mean, and
    keys that belong to other products get a message saying what to write.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    _section: ClassVar[str] = "config"
    """How messages name this dict ("parameters", "mpi", ...)."""
    _foreign_keys: ClassVar[dict[str, str]] = {}
    """Keys of other products or versions -> the rule explaining what to write."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError.from_problems(_problems_from_validation_error(exc, type(self))) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any):  # type: ignore[override]
        try:
            return super().model_validate(plain(obj), **kwargs)
        except ValidationError as exc:
            raise ConfigError.from_problems(_problems_from_validation_error(exc, cls)) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any):  # type: ignore[override]
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            raise ConfigError.from_problems(_problems_from_validation_error(exc, cls)) from None

    @classmethod
    def _accepted_keys(cls) -> set[str]:
        keys = set(cls.model_fields)
        for field in cls.model_fields.values():
            keys.update(getattr(field.validation_alias, "choices", ()))
        return keys

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Subclass hook: rewrite accepted-but-special keys before field validation."""
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        accepted = cls._accepted_keys()
        problems = [cls._unknown_key_problem(key, accepted) for key in data if key not in accepted]
        if problems:
            raise ConfigError.from_problems(problems)
        return cls._prepare(dict(data))

    @classmethod
    def _unknown_key_problem(cls, key: Any, accepted: set[str]) -> ConfigProblem:
        if key in cls._foreign_keys:
            return ConfigProblem((), cls._foreign_keys[key])
        visible = {k for k in accepted if not k.startswith("_")}
        return ConfigProblem((), f"unknown key {key!r} in {cls._section}; {did_you_mean(key, visible)}")
