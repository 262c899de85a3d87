#!/usr/bin/env python3
"""Print the probe extension's JSONL log ($SDNEXT_PROBE_LOG) as one short line per hook call.
usage: read_probe_log.py [LOG] [--last]   (--last: only the most recent request)"""
import json
import os
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
path = args[0] if args else os.environ.get("SDNEXT_PROBE_LOG", os.path.join(os.environ.get("HOSTS", os.path.expanduser("~/tome-hosts")), "sdnext", "run", "probe.jsonl"))
rows = [json.loads(line) for line in open(path, encoding="utf8") if line.strip()]
if "--last" in sys.argv:
    starts = [i for i, r in enumerate(rows) if r.get("hook", "").startswith("-----")]
    rows = rows[starts[-1]:] if starts else rows


def short(cls):
    return cls.rsplit(".", 1)[-1] if cls else None


for r in rows:
    if r.get("hook", "").startswith("-----"):
        print(f"{r['hook']}  xyz_axis: {r.get('xyz_axis')}")
        continue
    print(f"{r['seq']:>2} {r['hook']:<22} unet_calls={r['unet_calls_so_far']:<3} args={r['args']} "
          f"p.sd_model={short(r['p.sd_model'])} unet={short(r['p.sd_model.unet class'])} "
          f"shared.sd_model={short(r['shared.sd_model'])} same={r['same_object']} "
          f"enable_hr={r['enable_hr']} is_hr_pass={r['is_hr_pass']} size={r['size']} hr_to={r['hr_upscale_to']} "
          f"tome(method={r['opts.token_merging_method']} opts={r['opts.tome_ratio']} p={r['p.tome_ratio']} "
          f"applied={r['applied_tome']})"
          + (f" shapes={r['unet_call_shapes']}" if "unet_call_shapes" in r else ""))
