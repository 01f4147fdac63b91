"""The prompt text of one row: its ``template`` (``str.format`` over the row's fields) or its ``field``, and the
checks on that text. A problem is a ``(reason, detail)`` pair; the reasons are
:data:`pipeline.data.sources.REJECT_REASONS`."""

from __future__ import annotations

import _string  # the str.format field-name parser (CPython's, used by string.Formatter)
import string
from typing import Any, Dict, Optional, Tuple

from pipeline.data.readers import type_name
from pipeline.runtime.config import ConfigError, SourceConfig


def check_template(template: str, key: str) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
        firsts = [(name, _string.formatter_field_name_split(name)[0] if name else "")
                  for _, name, _, _ in parsed if name is not None]
    except ValueError as err:
        raise ConfigError(f"config key '{key}': not a valid str.format template: {err}") from None
    for name, first in firsts:
        if name == "" or isinstance(first, int):
            raise ConfigError(f"config key '{key}': positional fields ('{{}}', '{{0}}') are not allowed; "
                              "name the row's field, e.g. '{question}'")


class _FieldProblem(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _RowFormatter(string.Formatter):
    """str.format over a row that reports missing keys / wrong types instead of formatting garbage."""

    def get_field(self, field_name, args, kwargs):
        first, rest = _string.formatter_field_name_split(field_name)
        if first not in kwargs:
            raise _FieldProblem("missing_field", f"template key {first!r} not in the row")
        obj, path = kwargs[first], str(first)
        for is_attr, key in rest:
            if obj is None:
                raise _FieldProblem("missing_field", f"template field {path!r} is null")
            if isinstance(obj, (str, bytes)):
                raise _FieldProblem("wrong_type", f"template indexes into {path!r}, a string")
            try:
                obj = getattr(obj, key) if is_attr else obj[key]
            except (KeyError, IndexError):
                raise _FieldProblem("missing_field", f"template field {path}[{key!r}] is absent") from None
            except (TypeError, AttributeError):
                raise _FieldProblem("wrong_type", f"template field {path!r} ({type_name(obj)}) has no "
                                    f"{'attribute' if is_attr else 'item'} {key!r}") from None
            path += f".{key}" if is_attr else f"[{key!r}]"
        return obj, first

    def format_field(self, value, format_spec):
        if value is None:
            raise _FieldProblem("missing_field", "a template field is null")
        if isinstance(value, (dict, list, tuple, bytes, bytearray)):
            raise _FieldProblem("wrong_type", f"a template field is a {type_name(value)}, not a scalar")
        return super().format_field(value, format_spec)


_FORMATTER = _RowFormatter()


def row_text(src: SourceConfig, fields: Dict[str, Any],
             default_field: Optional[str] = None) -> Tuple[Optional[str], Optional[Tuple[str, str]]]:
    """The prompt text of one row: the template, else the field. Returns (text, None) or (None, (reason, detail))."""
    if src.template is not None:
        try:
            text = _FORMATTER.vformat(src.template, (), fields)
        except _FieldProblem as p:
            return None, (p.reason, p.detail)
        except (ValueError, TypeError) as err:  # e.g. a format spec that does not fit the value
            return None, ("wrong_type", f"template does not apply: {err}")
    else:
        name = default_field or src.field
        if name is None:
            return None, ("missing_field", "source has neither `field` nor `template`")
        if name not in fields:
            has = ", ".join(map(str, list(fields)[:8]))
            return None, ("missing_field", f"field {name!r} not in the row (has {has})")
        text = fields[name]
        if text is None:
            return None, ("missing_field", f"field {name!r} is null")
        if not isinstance(text, str):
            return None, ("wrong_type", f"field {name!r} is {type_name(text)}, not a string")
    return text, None


def text_problem(text: str) -> Optional[Tuple[str, str]]:
    """``undecodable`` (lone surrogates), ``nul_bytes`` or ``empty``; None when the text is usable."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return "undecodable", (f"lone surrogate U+{ord(text[err.start]):04X} at character {err.start} (an invalid "
                               "UTF-8 byte or an unpaired \\u escape)")
    if "\x00" in text:
        return "nul_bytes", f"NUL character at position {text.index(chr(0))}"
    if not text.strip():
        return "empty", "empty prompt" if not text else "whitespace-only prompt"
    return None
