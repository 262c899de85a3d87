"""Checks the extension in a running real A1111 webui, Forge, reForge or Forge Classic over its HTTP API (not a
pytest test: it needs the server).

Start the host (``../shared/harness/start.sh``, or ``forge/``, ``reforge/``, ``forge-classic/``) with this
repository linked as an extension and with a "unet failer" always-on script (``FAILER`` below: args [true] make
the ldm U-Net raise at its 2nd call of the job) for the failure check, then::

    python3 tests/webui_harness_check.py [--url http://127.0.0.1:7861] [--log .../run/a1111.log]

Prints one line per check (the pixels' md5, the infotext's ToMe entries, the console lines the job printed)
and exits 1 if a check fails. Standard library only; the server side of the helpers is shared with
``sdnext_harness_check.py``.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdnext_harness_check import FAILER, Server, check, describe, failures, tome_keys  # noqa: E402

HIRES = dict(enable_hr=True, hr_scale=2.0, hr_upscaler="Latent", hr_second_pass_steps=2, denoising_strength=0.5)
XYZ = "x/y/z plot"


def xyz_args(s: Server, label: str, values: str) -> list | None:
    """The X/Y/Z plot's script_args for one X axis: the axis by its index in the txt2img list, as the UI sends."""
    status, info = s.call("/sdapi/v1/script-info")
    if status != 200:
        return None
    for script in info:
        if script["name"] == XYZ and not script["is_img2img"]:
            choices = script["args"][0]["choices"]
            if label not in choices:
                return None
            index = choices.index(label)
            return [index, values, [], 0, "", [], 0, "", [], True, True, False, False, False, False, False, 0,
                    False]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("A1111_URL", "http://127.0.0.1:7861"))
    ap.add_argument("--log", default=os.path.expanduser("~/tome-bars/a1111-harness/run/a1111.log"))
    ap.add_argument("--forge", action="store_true", help="a Forge-family host: its hires fix over the API needs "
                    "hr_additional_modules")
    args = ap.parse_args()
    s = Server(args.url, args.log)
    if args.forge:
        HIRES["hr_additional_modules"] = ["Use same choices"]

    plain = s.generate()
    check("plain", plain["status"] == 200 and plain["keys"] == {}, describe(plain))
    tome = s.generate(tome=[{"enabled": True, "ratio": 0.5}])
    check("ToMe 0.5 changes the pixels", tome["md5"] not in (None, plain["md5"]) and tome["lines"] == []
          and tome["keys"] == {"ToMe ratio": "0.5"}, describe(tome))
    again = s.generate(tome=[{"enabled": True, "ratio": 0.5}])
    check("ToMe 0.5 again: the same pixels", again["md5"] == tome["md5"], describe(again))
    after = s.generate()
    check("plain after: the plain pixels", after["md5"] == plain["md5"], describe(after))
    positional = s.generate(tome=[True, 0.5])
    check("positional [true, 0.5] = the dict form", positional["md5"] == tome["md5"], describe(positional))
    by_method = {}
    for method in ("ToDo", "Local"):
        r = by_method[method] = s.generate(tome=[{"enabled": True, "ratio": 0.5, "method": method}])
        check(f"{method}", r["md5"] not in (None, plain["md5"], tome["md5"]) and r["lines"] == []
              and r["keys"] == {"ToMe ratio": "0.5", "ToMe method": method}, describe(r))
    weighted = s.generate(tome=[{"enabled": True, "ratio": 0.25, "method": "Local", "size_weighted_keys": True}])
    unweighted = s.generate(tome=[{"enabled": True, "ratio": 0.25, "method": "Local"}])
    check("size-weighted keys (Local 0.25)", weighted["md5"] not in (None, plain["md5"], unweighted["md5"])
          and weighted["keys"].get("ToMe size-weighted keys") == "True", describe(weighted))
    window = s.generate(tome=[{"enabled": True, "ratio": 0.5, "step_start": 0.5}])
    check("step window [0.5, 1]", window["md5"] not in (None, plain["md5"], tome["md5"]), describe(window))

    hires_plain = s.generate(**HIRES)
    check("hires plain", hires_plain["status"] == 200, describe(hires_plain))
    hires_all = s.generate(tome=[{"enabled": True, "ratio": 0.5}], **HIRES)
    hires_only = s.generate(tome=[{"enabled": True, "ratio": 0.5, "hr_only": True}], **HIRES)
    hires_ratio = s.generate(tome=[{"enabled": True, "ratio": 0.5, "hr_ratio": 0.3}], **HIRES)
    check("hires, both passes", hires_all["md5"] not in (None, hires_plain["md5"]), describe(hires_all))
    check("hires fix only", hires_only["md5"] not in (None, hires_plain["md5"], hires_all["md5"])
          and hires_only["keys"] == {"ToMe ratio": "0.5", "ToMe hires only": "True"}, describe(hires_only))
    check("hires ratio 0.3", hires_ratio["md5"] not in (None, hires_plain["md5"], hires_all["md5"])
          and hires_ratio["keys"] == {"ToMe ratio": "0.5", "ToMe hr ratio": "0.3"}, describe(hires_ratio))
    no_hires = s.generate(tome=[{"enabled": True, "hr_only": True}])
    check("hires fix only without hires: plain pixels", no_hires["md5"] == plain["md5"], describe(no_hires))

    bad = s.generate(tome=[{"enabled": True, "ratio": 2}])
    check("bad ratio: one line, plain pixels", bad["md5"] == plain["md5"] and len(bad["lines"]) == 1
          and bad["keys"] == {}, describe(bad))
    odd = s.generate(tome=[{"enabled": True, "ratio": 0.5}], width=136, height=72)
    check("odd size 136x72 runs", odd["status"] == 200 and odd["md5"] is not None, describe(odd))

    start = s.log_size()
    failed = s.generate(tome=[{"enabled": True, "ratio": 0.5}], alwayson_scripts={FAILER: {"args": [True]}})
    time.sleep(2)  # the server may log the traceback after it has answered
    check("failing job", "simulated failure" in s.log_since(start), f"status {failed['status']} md5 {failed['md5']}")
    after_failure = s.generate()
    check("plain after the failure: the plain pixels", after_failure["md5"] == plain["md5"], describe(after_failure))
    tome_after_failure = s.generate(tome=[{"enabled": True, "ratio": 0.5}])
    check("ToMe after the failure: the same ToMe pixels", tome_after_failure["md5"] == tome["md5"],
          describe(tome_after_failure))

    init = "data:image/png;base64," + base64.b64encode(plain["png"]).decode()
    i2i_plain = s.generate("img2img", init_images=[init], denoising_strength=0.6)
    i2i_tome = s.generate("img2img", tome=[{"enabled": True, "ratio": 0.5}], init_images=[init],
                          denoising_strength=0.6)
    check("img2img", i2i_tome["md5"] not in (None, i2i_plain["md5"]) and i2i_tome["keys"] == {"ToMe ratio": "0.5"},
          f"plain {i2i_plain['md5']} tome {describe(i2i_tome)}")

    script_args = xyz_args(s, "[ToMe] Ratio", "0.5,0.3")
    check("X/Y/Z axis listed", script_args is not None, "[ToMe] Ratio in the txt2img X/Y/Z plot's axes")
    if script_args is not None:
        grid = s.generate(script_name=XYZ, script_args=script_args)
        cells = [tome_keys(t) for t in grid.get("infotexts", [])]
        check("X/Y/Z grid over [ToMe] Ratio", grid["status"] == 200 and {"ToMe ratio": "0.5"} in cells
              and {"ToMe ratio": "0.3"} in cells and tome["md5"] in grid.get("md5s", []),
              f"{len(grid.get('md5s', []))} images cells {cells}")
    last = s.generate()
    check("plain at the end: the plain pixels", last["md5"] == plain["md5"], describe(last))
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
