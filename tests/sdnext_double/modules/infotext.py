"""SD.Next's infotext parser (modules/infotext.py): keys are ``[\\w ]+`` (a key with another character, such as
"-", is not read as such), values typed: numbers become int/float, "True"/"False" booleans, ``NxM`` splits."""

from __future__ import annotations

import json
import re

re_size = re.compile(r"^(\d+)x(\d+)$")
re_param = re.compile(r'\s*([\w ]+):\s*("(?:\\"[^,]|\\"|\\|[^\"])+"|[^,]*)(?:,|$)')

mapping = [("ToMe", "tome_ratio"), ("ToDo", "todo_ratio"), ("Model", "sd_model_checkpoint")]


def quote(text):
    if "," not in str(text) and "\n" not in str(text) and ":" not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def unquote(text):
    if not text or text[0] != '"' or text[-1] != '"':
        return text
    try:
        return json.loads(text)
    except Exception:
        return text


def parse(infotext):
    if not isinstance(infotext, str) or not infotext.strip():
        return {}
    lines = infotext.strip().split("\n")
    prompt = lines[0]
    negative = ""
    for line in lines[1:]:
        if line.lower().startswith("negative prompt:"):
            negative = line[len("negative prompt:"):].strip()
    params = dict(re_param.findall(lines[-1]))
    if not params:
        return {"Prompt": infotext}
    params["Prompt"] = prompt or None
    params["Negative prompt"] = negative or None
    for key, val in params.copy().items():
        if val is None:
            continue
        val = unquote(val).strip(" ,\n")
        size = re_size.match(val)
        if val.replace(".", "", 1).isdigit():
            params[key] = float(val) if "." in val else int(val)
        elif val == "True":
            params[key] = True
        elif val == "False":
            params[key] = False
        elif size is not None:
            params[f"{key}-1"], params[f"{key}-2"] = int(size.group(1)), int(size.group(2))
        else:
            params[key] = val
    return params
