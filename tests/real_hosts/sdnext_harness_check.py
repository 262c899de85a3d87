"""Checks the extension in a running real SD.Next over its HTTP API (not a pytest test: it needs the server).

``tests/real_hosts/run_host_check.sh sdnext`` sets SD.Next up, links this repository and
``tests/real_hosts/unet-failer`` (``FAILER`` below, for the failure and interrupt checks) into it, starts it, runs this, and
stops it. By hand, with SD.Next started (``tests/real_hosts/hosts/sdnext/start.sh``)::

    python3 tests/real_hosts/sdnext_harness_check.py [--url http://127.0.0.1:7865] [--log .../run/sdnext.log]

Prints one line per check (the pixels' md5, the infotext's ToMe entries, the console lines the job printed)
and exits 1 if a check fails. Standard library only. Pixels are compared by the md5 of the PNG's decoded
image data, so two images match exactly or not at all.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import struct
import sys
import time
import urllib.error
import urllib.request
import zlib

FAILER = "unet failer"  # always-on test script: args [true] make the U-Net raise at its 2nd call of the job
# (args [false, true]: press the host's Interrupt there instead)
# Cache at a schedule that reuses within the checks' 4 steps (steps 0, 1 and the last run whole, step 2 reuses).
CACHE = {"enabled": True, "method": "Cache", "cache_warmup": 1, "cache_interval": 2}
CACHE_KEYS = {"ToMe ratio": "0.5", "ToMe method": "Cache", "ToMe cache interval": "2", "ToMe cache warmup": "1"}
# SD.Next runs the refiner only in a job with hires fix on (here at scale 1, no upscaler: the refiner pass alone).
# ...and as a pipeline of its own, which the extension does not patch: a merged job says so once, and in its infotext.
REFINER_LINE = ("[ToMe] the refiner's steps run without ToMe (SD.Next runs its refiner as a pipeline of its own, "
                "which ToMe does not patch)")
REFINER_KEYS = {"ToMe refiner": "unmerged"}
REFINER = dict(enable_hr=True, hr_scale=1.0, hr_upscaler="None", hr_second_pass_steps=0, hr_denoising_strength=0.5,
               refiner_steps=4, refiner_start=0.5)
HIRES = dict(enable_hr=True, hr_scale=2.0, hr_upscaler="Latent Bilinear", hr_resize_mode=1, hr_second_pass_steps=2,
             hr_denoising_strength=0.5)
failures: list[str] = []


def idat_md5(png: bytes) -> str:
    pos, data = 8, b""
    while pos + 8 <= len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IDAT":
            data += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    return hashlib.md5(zlib.decompress(data)).hexdigest()


class Server:
    def __init__(self, url: str, log: str | None) -> None:
        self.url, self.log = url.rstrip("/"), log

    def call(self, path: str, payload: dict | None = None) -> tuple[int, object]:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=1800) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.read()[:2000]

    def log_size(self) -> int:
        return os.path.getsize(self.log) if self.log and os.path.exists(self.log) else 0

    def log_since(self, start: int) -> str:
        if not self.log or not os.path.exists(self.log):
            return ""
        with open(self.log, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def generate(self, tab: str = "txt2img", tome=None, **fields) -> dict:
        request = {"prompt": "a photo of a cat", "negative_prompt": "", "width": 128, "height": 128, "steps": 4,
                   "sampler_name": "Euler", "cfg_scale": 6.0, "seed": 1, "save_images": False, "send_images": True,
                   **fields}
        if tome is not None:
            request.setdefault("alwayson_scripts", {})["tome"] = {"args": tome}
        start = self.log_size()
        status, body = self.call(f"/sdapi/v1/{tab}", request)
        lines = [line for line in self.log_since(start).splitlines() if line.startswith("[ToMe]")]
        result = {"status": status, "lines": lines, "md5": None, "info": "", "keys": {}, "log": self.log_since(start)}
        if status == 200 and isinstance(body, dict):
            images = body.get("images") or []
            if images:
                png = base64.b64decode(images[0].split(",", 1)[-1])
                result["png"], result["md5"] = png, idat_md5(png)
                result["md5s"] = [idat_md5(base64.b64decode(i.split(",", 1)[-1])) for i in images]
            info = json.loads(body["info"]) if isinstance(body.get("info"), str) else body.get("info") or {}
            result["info"] = (info.get("infotexts") or [""])[0]
            result["infotexts"] = info.get("infotexts") or []
            result["keys"] = tome_keys(result["info"])
        return result


WEIGHTED = {"ToMe size-weighted keys": "True"}  # ToMe's "Auto" size-weighted keys, recorded in every ToMe image


def tome_keys(infotext: str) -> dict:
    last = infotext.strip().split("\n")[-1] if infotext else ""
    return dict(re.findall(r"(?:^|, )(ToMe[^:,]*|ToDo): ([^,]*)", last))


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        failures.append(name)


def describe(r: dict) -> str:
    return f"md5 {r['md5']} keys {r['keys']} lines {r['lines']}"


def check_basics(s: Server) -> tuple[dict, dict]:
    """Plain, ToMe 0.5 (the same twice, the same positional, plain again after it), ToDo, Local, Stack, Cache (the
    same twice), the step window and a bad ratio (one console line, plain pixels); returns the plain and the
    ToMe 0.5 results."""
    plain = s.generate()
    check("plain", plain["status"] == 200 and plain["keys"] == {}, describe(plain))
    tome = s.generate(tome=[{"enabled": True, "ratio": 0.5}])
    check("ToMe 0.5 changes the pixels", tome["md5"] not in (None, plain["md5"]) and tome["lines"] == []
          and tome["keys"] == {"ToMe ratio": "0.5", **WEIGHTED}, describe(tome))
    again = s.generate(tome=[{"enabled": True, "ratio": 0.5}])
    check("ToMe 0.5 again: the same pixels", again["md5"] == tome["md5"], describe(again))
    after = s.generate()
    check("plain after: the plain pixels", after["md5"] == plain["md5"], describe(after))
    positional = s.generate(tome=[True, 0.5])
    check("positional [true, 0.5] = the dict form", positional["md5"] == tome["md5"], describe(positional))
    unweighted = s.generate(tome=[{"enabled": True, "ratio": 0.5, "size_weighted_keys": False}])
    check("ToMe 0.5, size-weighted keys off: other pixels, no key", unweighted["md5"] not in
          (None, plain["md5"], tome["md5"]) and unweighted["keys"] == {"ToMe ratio": "0.5"}, describe(unweighted))
    for method in ("ToDo", "Local", "Stack"):
        r = s.generate(tome=[{"enabled": True, "ratio": 0.5, "method": method}])
        check(f"{method}", r["md5"] not in (None, plain["md5"], tome["md5"]) and r["lines"] == []
              and r["keys"] == {"ToMe ratio": "0.5", "ToMe method": method}, describe(r))
    cache = s.generate(tome=[CACHE])
    check("Cache (a full step every 2 after 1): its own pixels and keys", cache["md5"] not in
          (None, plain["md5"], tome["md5"]) and cache["lines"] == [] and cache["keys"] == CACHE_KEYS, describe(cache))
    cache_again = s.generate(tome=[CACHE])
    check("Cache again: the same pixels", cache_again["md5"] == cache["md5"], describe(cache_again))
    window = s.generate(tome=[{"enabled": True, "ratio": 0.5, "step_start": 0.5}])
    check("step window [0.5, 1]", window["md5"] not in (None, plain["md5"], tome["md5"]), describe(window))
    bad = s.generate(tome=[{"enabled": True, "ratio": 2}])
    check("bad ratio: one line, plain pixels", bad["md5"] == plain["md5"] and len(bad["lines"]) == 1
          and bad["keys"] == {}, describe(bad))
    return plain, tome


def check_hires(s: Server, plain: dict, hires: dict) -> None:
    """Hires fix: both passes merged, hires fix only, the hires pass's own ratio, and hires fix only in a job
    without hires fix (plain pixels and one console line). ``hires``: the host's request fields for it."""
    hires_plain = s.generate(**hires)
    check("hires plain", hires_plain["status"] == 200, describe(hires_plain))
    hires_all = s.generate(tome=[{"enabled": True, "ratio": 0.5}], **hires)
    hires_only = s.generate(tome=[{"enabled": True, "ratio": 0.5, "hr_only": True}], **hires)
    hires_ratio = s.generate(tome=[{"enabled": True, "ratio": 0.5, "hr_ratio": 0.3}], **hires)
    check("hires, both passes", hires_all["md5"] not in (None, hires_plain["md5"]), describe(hires_all))
    check("hires fix only", hires_only["md5"] not in (None, hires_plain["md5"], hires_all["md5"])
          and hires_only["keys"] == {"ToMe ratio": "0.5", "ToMe hires only": "True", **WEIGHTED},
          describe(hires_only))
    check("hires ratio 0.3", hires_ratio["md5"] not in (None, hires_plain["md5"], hires_all["md5"])
          and hires_ratio["keys"] == {"ToMe ratio": "0.5", "ToMe hr ratio": "0.3", **WEIGHTED},
          describe(hires_ratio))
    no_hires = s.generate(tome=[{"enabled": True, "hr_only": True}])
    check("hires fix only without hires", no_hires["md5"] == plain["md5"] and len(no_hires["lines"]) == 1,
          describe(no_hires))
    check_cache_hires(s, hires)


def check_cache_hires(s: Server, hires: dict) -> None:
    """Cache with hires fix: a hires pass of 4 steps at denoising 0.5 (the schedule reuses on its 2nd and 4th),
    on both passes and on the hires pass only (whose pixels differ from plain hires only if it reused there,
    starting afresh from the first pass's run at another size), the same pixels again."""
    hires = dict(hires, hr_second_pass_steps=8)
    plain = s.generate(**hires)
    both = s.generate(tome=[CACHE], **hires)
    again = s.generate(tome=[CACHE], **hires)
    only = s.generate(tome=[{**CACHE, "hr_only": True}], **hires)
    check("hires with Cache on both passes", both["md5"] not in (None, plain["md5"]) and both["lines"] == []
          and both["keys"] == CACHE_KEYS, describe(both))
    check("hires with Cache again: the same pixels", again["md5"] == both["md5"], describe(again))
    check("Cache on the hires pass only: it reuses there", only["md5"] not in (None, plain["md5"], both["md5"])
          and only["keys"] == {**CACHE_KEYS, "ToMe hires only": "True"}, describe(only))


def check_refiner(s: Server, plain: dict) -> None:
    """SD.Next's refiner pass (a second pipeline loaded from the refiner setting, here the same model again, run
    after the base steps as img2img): Cache and ToMe change the base pass's pixels, the same again, each saying
    in one line and in its infotext that the refiner's steps are unmerged; plain jobs with the refiner give the
    same pixels before and after them; plain without the refiner afterwards."""
    _, options = s.call("/sdapi/v1/options")
    s.call("/sdapi/v1/options", {"sd_model_refiner": options["sd_model_checkpoint"]})
    try:
        refined_plain = s.generate(**REFINER)
        cache = s.generate(tome=[CACHE], **REFINER)
        cache_again = s.generate(tome=[CACHE], **REFINER)
        tome = s.generate(tome=[{"enabled": True, "ratio": 0.5}], **REFINER)
        refined_after = s.generate(**REFINER)
    finally:
        s.call("/sdapi/v1/options", {"sd_model_refiner": "None"})
    check("refiner plain", refined_plain["status"] == 200 and "Refiner steps: " in refined_plain["info"]
          and refined_plain["md5"] != plain["md5"] and refined_plain["keys"] == {}, describe(refined_plain))
    check("refiner with Cache: its own pixels and keys", cache["md5"] not in (None, refined_plain["md5"])
          and cache["lines"] == [REFINER_LINE] and cache["keys"] == {**CACHE_KEYS, **REFINER_KEYS}
          and "Refiner steps: " in cache["info"],
          describe(cache))
    check("refiner with Cache again: the same pixels", cache_again["md5"] == cache["md5"], describe(cache_again))
    check("refiner with ToMe 0.5", tome["md5"] not in (None, refined_plain["md5"], cache["md5"])
          and tome["lines"] == [REFINER_LINE] and tome["keys"] == {"ToMe ratio": "0.5", **WEIGHTED, **REFINER_KEYS},
          describe(tome))
    check("refiner plain after them: the same pixels", refined_after["md5"] == refined_plain["md5"],
          describe(refined_after))
    after = s.generate()
    check("plain without the refiner after it: the plain pixels", after["md5"] == plain["md5"], describe(after))


def check_failure_and_img2img(s: Server, plain: dict, tome: dict) -> None:
    """A job whose U-Net raises (``FAILER``), then plain and ToMe pixels as before it; a Cache job that raises,
    and one the host's Interrupt stops, then Cache's pixels as without them; and img2img from the plain image,
    which ToMe changes."""
    start = s.log_size()
    failed = s.generate(tome=[{"enabled": True, "ratio": 0.5}], alwayson_scripts={FAILER: {"args": [True]}})
    time.sleep(2)  # the server may log the traceback after it has answered
    check("failing job", "simulated failure" in s.log_since(start), f"status {failed['status']} md5 {failed['md5']}")
    after_failure = s.generate()
    check("plain after the failure: the plain pixels", after_failure["md5"] == plain["md5"], describe(after_failure))
    tome_after_failure = s.generate(tome=[{"enabled": True, "ratio": 0.5}])
    check("ToMe after the failure: the same ToMe pixels", tome_after_failure["md5"] == tome["md5"],
          describe(tome_after_failure))
    cache = s.generate(tome=[CACHE])
    start = s.log_size()
    s.generate(tome=[CACHE], alwayson_scripts={FAILER: {"args": [True]}}, seed=4321)
    time.sleep(2)
    check("failing Cache job", "simulated failure" in s.log_since(start), "the U-Net raised at its 2nd call")
    fresh = s.generate(tome=[CACHE])
    check("Cache after a failing Cache job: the pixels it had before", fresh["md5"] == cache["md5"]
          and fresh["keys"] == CACHE_KEYS, describe(fresh))
    # Interrupted the host's own way (``FAILER`` presses Interrupt at the U-Net's 2nd call): the host stops the
    # job early; the next Cache job of that seed makes the whole job's pixels, the next plain one plain pixels.
    whole = s.generate(tome=[CACHE], seed=4321)
    start = s.log_size()
    interrupted = s.generate(tome=[CACHE], alwayson_scripts={FAILER: {"args": [False, True]}}, seed=4321)
    time.sleep(1)
    log = s.log_since(start)
    # The A1111 WebUI and the Forge family decode the latent sampled so far: other pixels. SD.Next drops the job's
    # latent, logs "Interrupted...", and answers with an image of an earlier job (here the whole job's).
    check("interrupted Cache job: the host stopped it early", "Interrupt pressed" in log
          and (interrupted["md5"] != whole["md5"] or "Interrupted..." in log),
          f"{describe(interrupted)}; the whole job's md5 {whole['md5']}")
    again = s.generate(tome=[CACHE], seed=4321)
    check("Cache after an interrupted Cache job: the whole job's pixels", again["md5"] == whole["md5"] is not None
          and again["keys"] == CACHE_KEYS, describe(again))
    after_interrupt = s.generate()
    check("plain after the interrupted job: the plain pixels", after_interrupt["md5"] == plain["md5"],
          describe(after_interrupt))

    init = "data:image/png;base64," + base64.b64encode(plain["png"]).decode()
    i2i_plain = s.generate("img2img", init_images=[init], denoising_strength=0.6)
    i2i_tome = s.generate("img2img", tome=[{"enabled": True, "ratio": 0.5}], init_images=[init],
                          denoising_strength=0.6)
    check("img2img", i2i_tome["md5"] not in (None, i2i_plain["md5"])
          and i2i_tome["keys"] == {"ToMe ratio": "0.5", **WEIGHTED},
          f"plain {i2i_plain['md5']} tome {describe(i2i_tome)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("SDNEXT_URL", "http://127.0.0.1:7865"))
    ap.add_argument("--log", default=os.path.join(os.environ.get("HOSTS", os.path.expanduser("~/tome-hosts")),
                                                  "sdnext", "run", "sdnext.log"), help="the host's console log")
    s = Server(ap.parse_args().url, ap.parse_args().log)

    plain, tome = check_basics(s)

    check_hires(s, plain, HIRES)
    check_refiner(s, plain)

    # SD.Next's built-in token merging: a setting a job with the accordion sets aside, and back after it.
    s.call("/sdapi/v1/options", {"token_merging_method": "ToMe", "tome_ratio": 0.5})
    builtin_only = s.generate()
    aside = s.generate(tome=[{"enabled": True, "ratio": 0.5}])
    status, options = s.call("/sdapi/v1/options")
    builtin_back = s.generate()
    s.call("/sdapi/v1/options", {"token_merging_method": "None", "tome_ratio": 0.0})
    check("built-in ToMe alone (its own job)", "Applying ToMe: ratio=0.5" in builtin_only["log"]
          and builtin_only["keys"] == {"ToMe": "0.5"}, describe(builtin_only))
    check("built-in ToMe set aside for the accordion's job", "Applying ToMe" not in aside["log"]
          and aside["md5"] == tome["md5"] and aside["keys"] == {"ToMe ratio": "0.5", **WEIGHTED} and len(aside["lines"]) == 1,
          describe(aside))
    check("built-in settings back after the job", isinstance(options, dict) and options.get("tome_ratio") == 0.5
          and options.get("token_merging_method") == "ToMe" and "Applying ToMe: ratio=0.5" in builtin_back["log"],
          f"tome_ratio={options.get('tome_ratio') if isinstance(options, dict) else options!r}")

    # A job whose sampling fails: SD.Next logs it and skips postprocess; nothing of ours may stay.
    check_failure_and_img2img(s, plain, tome)

    # X/Y/Z grid: our axes are listed, and a grid over the ratio runs one job per value.
    status, axes = s.call("/sdapi/v1/xyz-grid")
    ours = [a["label"] for a in axes if a["label"].startswith("[ToMe]")] if isinstance(axes, list) else []
    check("X/Y/Z axes listed", "[ToMe] Ratio" in ours and "[ToMe] Method" in ours, f"{ours}")
    grid = s.generate(script_name="xyz grid script", script_args=[
        "[ToMe] Ratio", "0.5,0.3", "", "Nothing", "", "", "Nothing", "", "",
        False, True, False, True, False, True, False, False])
    cells = [tome_keys(t) for t in grid.get("infotexts", [])]
    check("X/Y/Z grid over [ToMe] Ratio", grid["status"] == 200 and {"ToMe ratio": "0.5", **WEIGHTED} in cells
          and {"ToMe ratio": "0.3", **WEIGHTED} in cells and tome["md5"] in grid.get("md5s", []),
          f"{len(grid.get('md5s', []))} images {grid.get('md5s')} cells {cells}")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
