#!/usr/bin/env python3
"""Send txt2img requests to one of the harness hosts (/sdapi/v1/txt2img); print the time, the image's size, a hash
of its pixels (the md5 of the PNG's decoded image data: same pixels, same hash, whatever the infotext says) and the
infotext; optionally save the first image (PNG) and the response's info JSON.

usage: txt2img.py HOST [--url URL] [--prompt P] [--size N] [--steps N] [--sampler NAME] [--seed N] [--cfg X]
                  [--tome R] [--hires] [--probe] [--script NAME --args '[...]'] [--json '{"key": "value"}']
                  [--repeat N] [--timeout S] [--out FILE.png] [--info-out FILE.json]
  HOST        a1111, forge, reforge, forge-classic, forge-neo or sdnext; each host's folder has a txt2img.py that
              is this one with its HOST (e.g. forge/txt2img.py --size 256 = txt2img.py forge --size 256)
  --url       default: the host's URL from its env.sh ($FORGE_URL ...), else 127.0.0.1 at the host's port
  --tome R    the host's built-in token merging at ratio R, by override_settings (the webuis: token_merging_ratio;
              SD.Next: token_merging_method ToMe and tome_ratio)
  --hires     hires fix: A1111 x1.5, 1 second-pass step, denoising_strength 0.7 (its API answers 500 without one);
              SD.Next the checks' x2 "Latent Bilinear", 2 second-pass steps, denoise 0.5
  --probe     SD.Next: turn the harness probe extension on (alwayson_scripts)
  --script NAME --args JSON   another always-on script and its args (a JSON list)
  --json      extra payload keys, merged last
Exits 1 on an HTTP error, 2 when the answer holds no image. Standard library only: any python3 runs it."""
import argparse
import base64
import hashlib
import json
import os
import struct
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/real_hosts
from sdnext_harness_check import HIRES, idat_md5  # noqa: E402  (the checks' hires fix; the pixels' md5)

WEBUI = {"prompt": "a photo of a cat", "size": 256, "steps": 4, "cfg": 7.0, "fields": {"scheduler": "Automatic"}}
HOSTS = {  # the URL's variable, the port, the payload's defaults, what --hires sends and the probe's title
    "a1111": {"env": "A1111_URL", "port": 7861, "prompt": "a cat", "size": 512, "steps": 2, "cfg": 7.0, "fields": {},
              "hires": {"enable_hr": True, "hr_scale": 1.5, "hr_second_pass_steps": 1, "denoising_strength": 0.7}},
    "forge": {"env": "FORGE_URL", "port": 7862, **WEBUI},
    "reforge": {"env": "REFORGE_URL", "port": 7863, **WEBUI},
    "forge-classic": {"env": "FCLASSIC_URL", "port": 7864, **WEBUI},
    "forge-neo": {"env": "NEO_URL", "port": 7866, **WEBUI},
    "sdnext": {"env": "SDNEXT_URL", "port": 7865, "prompt": "a photo of a cat", "size": 128, "steps": 4, "cfg": 6.0,
               "fields": {"batch_size": 1, "n_iter": 1, "send_images": True}, "hires": HIRES,
               "probe": "sdnext harness probe"},
}


def payload(host, a):
    h = HOSTS[host]
    req = {"prompt": a.prompt or h["prompt"], "negative_prompt": "", "width": a.size, "height": a.size,
           "steps": a.steps, "sampler_name": a.sampler, "cfg_scale": a.cfg, "seed": a.seed, "save_images": False,
           **h["fields"]}
    if a.tome is not None:
        req["override_settings"] = ({"token_merging_method": "ToMe" if a.tome > 0 else "None", "tome_ratio": a.tome}
                                    if host == "sdnext" else {"token_merging_ratio": a.tome})
    if a.hires:
        req.update(h["hires"])
    scripts = {}
    if a.probe:
        scripts[h["probe"]] = {"args": [True]}
    if a.script:
        scripts[a.script] = {"args": json.loads(a.args)}
    if scripts:
        req["alwayson_scripts"] = scripts
    req.update(json.loads(a.json))
    return req


def describe(image):
    """the image's size and the md5 of its pixels (PNG), else of its bytes"""
    if image[:8] == b"\x89PNG\r\n\x1a\n":
        w, h = struct.unpack(">II", image[16:24])
        return f"PNG {w}x{h} {len(image)} bytes, pixels md5 {idat_md5(image)}"
    # SD.Next encodes API images in opts.samples_format (its start.sh sets png; SD.Next's default is jpg)
    return f"{image[:3].hex()}... {len(image)} bytes, NOT PNG (samples_format?), bytes md5 {hashlib.md5(image).hexdigest()}"


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in HOSTS:
        sys.exit(f"usage: txt2img.py HOST [options]  (HOST: {', '.join(HOSTS)}; HOST --help lists the options)")
    host = sys.argv.pop(1)
    h = HOSTS[host]
    ap = argparse.ArgumentParser(prog=f"txt2img.py {host}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get(h["env"], f"http://127.0.0.1:{h['port']}"))
    ap.add_argument("--prompt", default=None, help=f"default {h['prompt']!r}")
    ap.add_argument("--size", type=int, default=h["size"], help="width = height (a multiple of 8)")
    ap.add_argument("--steps", type=int, default=h["steps"])
    ap.add_argument("--sampler", default="Euler")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cfg", type=float, default=h["cfg"])
    ap.add_argument("--tome", type=float, default=None, help="the host's built-in token merging at this ratio")
    if "hires" in h:
        ap.add_argument("--hires", "--hr", action="store_true", help="hires fix")
    if "probe" in h:
        ap.add_argument("--probe", action="store_true", help="turn the harness probe extension on")
    ap.add_argument("--script", default=None, help="an always-on script's title")
    ap.add_argument("--args", default="[]", help="its args (JSON list)")
    ap.add_argument("--json", default="{}", help="extra payload keys (JSON), merged last")
    ap.add_argument("--repeat", type=int, default=1, help="send the request N times, report each time")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="write the first image here")
    ap.add_argument("--info-out", default=None, help="write the last response's info (JSON) here")
    ap.set_defaults(hires=False, probe=False)
    a = ap.parse_args()
    req = payload(host, a)
    info = {}
    for i in range(a.repeat):
        r = urllib.request.Request(a.url.rstrip("/") + "/sdapi/v1/txt2img", data=json.dumps(req).encode(),
                                   headers={"Content-Type": "application/json"})
        t0 = time.time()
        try:
            with urllib.request.urlopen(r, timeout=a.timeout) as resp:
                code, body = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            print(f"HTTP {e.code} after {time.time() - t0:.2f}s: {e.read()[:3000]!r}")
            sys.exit(1)
        dt = time.time() - t0
        images = body.get("images") or []
        info = body.get("info") or {}
        info = json.loads(info) if isinstance(info, str) else info
        msg = f"HTTP {code} time {dt:.2f}s images {len(images)}"
        if images:
            image = base64.b64decode(images[0].split(",", 1)[-1])
            msg += " | " + describe(image)
            if a.out and i == 0:
                with open(a.out, "wb") as f:
                    f.write(image)
        print(msg)
        if not images:
            sys.exit(2)
    if a.info_out:
        with open(a.info_out, "w", encoding="utf8") as f:
            json.dump(info, f, indent=1)
    print("infotext:", (info.get("infotexts") or [""])[0])


if __name__ == "__main__":
    main()
