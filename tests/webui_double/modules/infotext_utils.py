"""Infotext as the webui writes, parses and pastes it.

Writing: ``Key: value`` pairs joined by ", " after the prompt lines; a value holding ",", ":" or a newline is
JSON-quoted; a value equal to its key is written bare. Parsing gives strings only; an ``NxM`` value becomes
``Key-1``/``Key-2``. Pasting: per field, a missing key (or a callable returning None) leaves the control as it
is; otherwise the value is cast to the type of the control's value ("False" is the only false string).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, NamedTuple

from modules import script_callbacks

_SIZE = re.compile(r"^(\d+)x(\d+)$")
_KEY = re.compile(r"\s*([^:,]+?):\s*")


class PasteField(NamedTuple):
    component: Any
    target: str | Callable[[dict], Any]
    api: str | None = None

    @property
    def label(self) -> str | None:
        return None if callable(self.target) else self.target

    @property
    def function(self) -> Callable[[dict], Any] | None:
        return self.target if callable(self.target) else None


def quote(value: Any) -> str:
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def join_parameters(params: dict[str, Any]) -> str:
    return ", ".join(key if key == value else f"{key}: {quote(value)}" for key, value in params.items()
                     if value is not None)


def parse_parameters_line(line: str) -> dict[str, str]:
    result: dict[str, str] = {}
    pos = 0
    while pos < len(line):
        match = _KEY.match(line, pos)
        if match is None:  # a bare key, or trailing separators
            end = line.find(",", pos)
            end = len(line) if end < 0 else end
            word = line[pos:end].strip()
            if word:
                result[word] = word
            pos = end + 1
            continue
        key, pos = match.group(1).strip(), match.end()
        if line.startswith('"', pos):
            value, pos = json.JSONDecoder().raw_decode(line, pos)
        else:
            end = line.find(",", pos)
            end = len(line) if end < 0 else end
            value, pos = line[pos:end].strip(), end
        comma = line.find(",", pos)
        pos = len(line) if comma < 0 else comma + 1
        size = _SIZE.match(str(value))
        if size:
            result[f"{key}-1"], result[f"{key}-2"] = size.group(1), size.group(2)
        else:
            result[key] = str(value)
    return result


def parse_generation_parameters(text: str) -> dict[str, str]:
    lines = text.strip().split("\n")
    params = parse_parameters_line(lines[-1]) if len(lines) > 1 or ": " in lines[-1] else {}
    prompt_lines = lines[:-1] if params else lines
    prompt, negative, in_negative = [], [], False
    for line in prompt_lines:
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    result = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    result.update(params)
    return result


NO_CHANGE = object()


def paste_values(fields: list, text: str) -> list[Any]:
    """What each field's control becomes when ``text`` is pasted: a value, or NO_CHANGE."""
    params = parse_generation_parameters(text)
    script_callbacks.infotext_pasted_callback(text, params)
    out = []
    for field in fields:
        component, target = field[0], field[1]
        value = target(params) if callable(target) else params.get(target)
        if value is None:
            out.append(NO_CHANGE)
            continue
        if isinstance(value, dict) and value.get("__type__") == "update":
            out.append(value.get("value", NO_CHANGE))
            continue
        kind = type(component.value)
        try:
            if kind is bool and value == "False":
                out.append(False)
            elif kind is int:
                out.append(float(value))
            else:
                out.append(kind(value))
        except (TypeError, ValueError):
            out.append(NO_CHANGE)
    return out
