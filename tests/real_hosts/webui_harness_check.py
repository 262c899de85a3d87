"""Checks the extension in a running real A1111 webui, Forge, Forge Neo, reForge or Forge Classic over its HTTP
API (not a pytest test: it needs the server).

``tests/real_hosts/run_host_check.sh a1111`` (or ``forge``, ``forge-neo``, ``reforge``, ``forge-classic``) sets
the host up, links this repository and ``tests/real_hosts/unet-failer`` (an always-on script, ``FAILER`` below:
args [true] make the U-Net raise at its 2nd call of the job, for the failure check; [false, true] press the
host's Interrupt there) into it, starts it, runs this, and stops it. By hand, with the host started (``tests/real_hosts/hosts/<host>/start.sh``)::

    python3 tests/real_hosts/webui_harness_check.py [--forge] [--url http://127.0.0.1:7861] [--log .../run/a1111.log]

Prints one line per check (the pixels' md5, the infotext's ToMe entries, the console lines the job printed)
and exits 1 if a check fails. Standard library only; the server side of the helpers is shared with
``sdnext_harness_check.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdnext_harness_check import (CACHE, CACHE_KEYS, Server, WEIGHTED, check, check_basics,  # noqa: E402
                                  check_failure_and_img2img, check_hires, describe, failures, tome_keys)

HIRES = dict(enable_hr=True, hr_scale=2.0, hr_upscaler="Latent", hr_second_pass_steps=2, denoising_strength=0.5)
XYZ = "x/y/z plot"


def xyz_args(s: Server, label: str, values: str | list[str]) -> list | None:
    """The X/Y/Z plot's script_args for one X axis: the axis by its index in the txt2img list, as the UI sends,
    the legend and each cell's image on, every other argument at the default the host lists (reForge's script
    has three more than A1111 1.10's, in the middle). ``values``: the text field's, or a list for an axis with
    choices, which the plot takes from its dropdown."""
    status, info = s.call("/sdapi/v1/script-info")
    if status != 200:
        return None
    for script in info:
        if script["name"] == XYZ and not script["is_img2img"]:
            choices = script["args"][0]["choices"]
            if label not in choices:
                return None
            index = choices.index(label)
            args = [arg.get("value") for arg in script["args"]]
            text, dropdown = ("", values) if isinstance(values, list) else (values, [])
            args[:9] = [index, text, dropdown, 0, "", [], 0, "", []]  # X on the axis, no Y or Z
            for i, arg in enumerate(script["args"]):
                if arg.get("label") in ("Draw legend", "Include Sub Images"):
                    args[i] = True
            return args
    return None


def check_builtin(s: Server, plain: dict, tome: dict) -> None:
    """The host's built-in token merging (``token_merging_ratio``, through the request's override_settings): it
    changes the pixels alone; with the accordion on as well it is set aside for the job (one console line, the
    pixels of ToMe alone, no built-in entry in the infotext); and the plain pixels come back after it."""
    builtin = {"override_settings": {"token_merging_ratio": 0.5}}
    alone = s.generate(**builtin)
    check("built-in token merging alone", alone["md5"] not in (None, plain["md5"], tome["md5"])
          and "Token merging ratio: 0.5" in alone["info"], describe(alone))
    both = s.generate(tome=[{"enabled": True, "ratio": 0.5}], **builtin)
    check("built-in set aside for the accordion", both["md5"] == tome["md5"] and len(both["lines"]) == 1
          and "built-in token merging (token_merging_ratio=0.5) is off" in both["lines"][0]
          and "Token merging ratio" not in both["info"], describe(both))
    after = s.generate()
    check("plain after the built-in: the plain pixels", after["md5"] == plain["md5"], describe(after))


def check_hypertile(s: Server) -> None:
    """The A1111 WebUI's built-in Hypertile (its forward set on every attention layer): ToMe sets it aside on
    the layers it merges, with size-weighted keys on (ToMe's Auto, whose attention there is its own forward),
    and the next Hypertile job tiles as the one before it did."""
    hypertile = {"override_settings": {"hypertile_enable_unet": True, "hypertile_max_tile_unet": 64,
                                       "hypertile_max_depth_unet": 3}, "width": 256, "height": 256}
    plain = s.generate(width=256, height=256)
    tiled = s.generate(**hypertile)
    check("Hypertile alone tiles", tiled["md5"] not in (None, plain["md5"]), describe(tiled))
    merged = s.generate(tome=[{"enabled": True, "ratio": 0.5}], **hypertile)
    check("Hypertile and ToMe: set aside on the merged layers", merged["md5"] not in (None, tiled["md5"])
          and merged["keys"].get("ToMe Hypertile") == "set aside on merged blocks"
          and merged["keys"].get("ToMe size-weighted keys") == "True", describe(merged))
    again = s.generate(**hypertile)
    check("Hypertile alone after: the same tiled pixels", again["md5"] == tiled["md5"], describe(again))


def checkpoint_name(title: str) -> str:
    """A checkpoint's name without its hash and file extension: "random-sd15.safetensors [abc123]" → "random-sd15"."""
    name = re.sub(r"\s*\[[0-9a-fA-F]+\]$", "", title)
    return os.path.splitext(name)[0] if name.endswith((".safetensors", ".ckpt")) else name


def check_refiner(s: Server, plain: dict) -> None:
    """The refiner, switched in at the job's 2nd step of 4 (by steps where the host lets one choose): a second
    checkpoint of the same weights (``run_host_check.sh`` links one), so the plain refiner job has the plain
    pixels. With Cache, the 2nd step is a reused one by the schedule; on the refiner it must run whole (the
    base model's kept changes dropped: A1111 loads the refiner into the same modules, Forge builds a new
    model), so the pixels differ from Cache's alone although the weights are the same."""
    status, models = s.call("/sdapi/v1/sd-models")
    titles = [m.get("title", "") for m in models] if status == 200 and isinstance(models, list) else []
    status, options = s.call("/sdapi/v1/options")
    options = options if status == 200 and isinstance(options, dict) else {}
    # The loaded checkpoint: the setting (empty in reForge until one is chosen), else the plain image's "Model:".
    named = re.search(r"(?:^|, )Model: ([^,]+)", plain["info"])
    loaded = options.get("sd_model_checkpoint") or (named.group(1) if named else "")
    refiner = next((t for t in titles if t and checkpoint_name(t) != checkpoint_name(loaded)), None)
    check("a second checkpoint for the refiner", bool(loaded) and refiner is not None,
          f"loaded {loaded!r}, refiner {refiner!r} of {titles}")
    if refiner is None:
        return
    by_steps = {"refiner_use_steps": True} if "refiner_use_steps" in options else {}
    job = dict(refiner_checkpoint=refiner, refiner_switch_at=0.2, override_settings=by_steps)
    cache = s.generate(tome=[CACHE], override_settings=by_steps)
    refined = s.generate(**job)
    check("refiner of the same weights: the plain pixels", refined["md5"] == plain["md5"]
          and "Refiner: " in refined["info"], describe(refined))
    refined_cache = s.generate(tome=[CACHE], **job)
    check("Cache with the refiner: its first refiner step runs whole", refined_cache["md5"] not in
          (None, plain["md5"], cache["md5"]) and refined_cache["keys"] == CACHE_KEYS
          and "Refiner: " in refined_cache["info"], describe(refined_cache))
    again = s.generate(tome=[CACHE], **job)
    check("Cache with the refiner again: the same pixels", again["md5"] == refined_cache["md5"], describe(again))
    after = s.generate(tome=[CACHE], override_settings=by_steps)
    check("Cache after the refiner jobs: Cache's own pixels", after["md5"] == cache["md5"], describe(after))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("A1111_URL", "http://127.0.0.1:7861"))
    ap.add_argument("--log", default=os.path.join(os.environ.get("HOSTS", os.path.expanduser("~/tome-hosts")),
                                                  "a1111", "run", "a1111.log"), help="the host's console log")
    ap.add_argument("--forge", action="store_true", help="a Forge-family host: its hires fix over the API needs "
                    "hr_additional_modules")
    args = ap.parse_args()
    s = Server(args.url, args.log)
    hires = dict(HIRES, hr_additional_modules=["Use same choices"]) if args.forge else HIRES

    plain, tome = check_basics(s)
    weighted = s.generate(tome=[{"enabled": True, "ratio": 0.25, "method": "Local", "size_weighted_keys": True}])
    unweighted = s.generate(tome=[{"enabled": True, "ratio": 0.25, "method": "Local"}])
    check("size-weighted keys (Local 0.25)", weighted["md5"] not in (None, plain["md5"], unweighted["md5"])
          and weighted["keys"].get("ToMe size-weighted keys") == "True", describe(weighted))

    check_builtin(s, plain, tome)
    check_hires(s, plain, hires)

    odd = s.generate(tome=[{"enabled": True, "ratio": 0.5}], width=136, height=72)
    check("odd size 136x72 runs", odd["status"] == 200 and odd["md5"] is not None, describe(odd))

    check_failure_and_img2img(s, plain, tome)
    check_refiner(s, plain)

    # 0.5 second: reForge's grid gives its first cell other pixels than the same job alone, ToMe or not (a
    # Steps "4,4" grid without ToMe: the first cell differs from the plain image, the second equals it).
    script_args = xyz_args(s, "[ToMe] Ratio", "0.3,0.5")
    check("X/Y/Z axis listed", script_args is not None, "[ToMe] Ratio in the txt2img X/Y/Z plot's axes")
    if script_args is not None:
        grid = s.generate(script_name=XYZ, script_args=script_args)
        cells = [tome_keys(t) for t in grid.get("infotexts", [])]
        check("X/Y/Z grid over [ToMe] Ratio", grid["status"] == 200 and {"ToMe ratio": "0.5", **WEIGHTED} in cells
              and {"ToMe ratio": "0.3", **WEIGHTED} in cells and tome["md5"] in grid.get("md5s", []),
              f"{len(grid.get('md5s', []))} images cells {cells}")
    switch_args = xyz_args(s, "[ToMe] Size-weighted keys", ["Auto", "Off"])
    check("X/Y/Z size-weighted axis listed", switch_args is not None, "[ToMe] Size-weighted keys in the axes")
    if switch_args is not None:
        grid = s.generate(script_name=XYZ, script_args=switch_args)
        cells = [tome_keys(t) for t in grid.get("infotexts", [])]
        check("X/Y/Z grid over [ToMe] Size-weighted keys", grid["status"] == 200
              and {"ToMe ratio": "0.5", **WEIGHTED} in cells and {"ToMe ratio": "0.5"} in cells
              and len(set(grid.get("md5s", [])[-2:])) == 2, f"{len(grid.get('md5s', []))} images cells {cells}")
    if not args.forge:  # the Forge family's Hypertile is another extension with other settings
        check_hypertile(s)
    last = s.generate()
    check("plain at the end: the plain pixels", last["md5"] == plain["md5"], describe(last))
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
