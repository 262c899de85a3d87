#!/usr/bin/env python
"""Write a RANDOM-weight Stable Diffusion 1.5 model as a diffusers folder, fully offline, for SD.Next.

SD.Next lists every folder under models/Diffusers/ that holds a model_index.json; its _class_name
(StableDiffusionPipeline) makes modules/sd_detect.py report the family "Stable Diffusion" (= SD 1.x), and the
folder is loaded with StableDiffusionPipeline.from_pretrained. So only the *component configs* decide the size.

  --size small (default)  SD 1.5's block layout, narrower: U-Net CrossAttnDownBlock2D x3 + DownBlock2D,
                          2 resnets/level, 8 attention heads, block_out_channels 64/128/256/256,
                          cross_attention_dim 768 (the real context shape: 77 x 768); CLIP-L text encoder
                          cut to 2 layers (hidden 768, real 49408-token vocab); VAE 32/32/64/64, 1 resnet/level
                          (still 8x down-sampling, 4 latent channels, scaling 0.18215). 91M params, about 185 MB (fp16);
                          most of it is the text encoder's 49408 x 768 token embedding.
  --size full             the real SD 1.5 shapes, read from SD.Next's configs/sd15/*/config.json
                          (U-Net 860M, CLIP-L 123M, VAE 84M params); about 2.1 GB (fp16). Much slower on this CPU.

Tokenizer (vocab.json/merges.txt) and scheduler config are copied from SD.Next's configs/sd15/ (local files).
No safety checker / feature extractor (model_index entries [null, null], requires_safety_checker false).

Randomisation: default initialisation, then every LayerNorm/GroupNorm gets weight 1+0.1*N and bias 0.1*N
(a text encoder whose final LayerNorm has weight 1 / bias 0 gives hidden states of mean exactly 0; prompt
emphasis code that rescales by the mean then divides by ~0), the U-Net conv_out is rescaled so the predicted
noise has std ~1, and the VAE decoder conv_out so decoded pixels have std ~0.5. Images look like noise.

Usage (the SD.Next venv's python):
  python make_model.py --sdnext $SDNEXT --out $SDNEXT/models/Diffusers/tiny-sd15 [--size small|full] [--seed 1234]
"""
import argparse
import json
import os
import shutil
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--sdnext", required=True, help="SD.Next source tree (configs/sd15 is read from it)")
ap.add_argument("--out", required=True, help="target folder (replaced); put it under models/Diffusers/")
ap.add_argument("--size", choices=["small", "full"], default="small")
ap.add_argument("--seed", type=int, default=1234)
ap.add_argument("--fp32", action="store_true", help="store fp32 weights (default fp16; SD.Next on CPU computes in fp32 anyway)")
a = ap.parse_args()

import torch  # noqa: E402
from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer  # noqa: E402

t0 = time.time()
torch.manual_seed(a.seed)
CFG = os.path.join(os.path.abspath(a.sdnext), "configs", "sd15")


def read(rel):
    with open(os.path.join(CFG, rel), encoding="utf8") as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


unet_cfg, vae_cfg = read("unet/config.json"), read("vae/config.json")
te_cfg = read("text_encoder/config.json")
te_cfg.pop("architectures", None)
te_cfg.pop("torch_dtype", None)
te_cfg.pop("transformers_version", None)
if a.size == "small":
    unet_cfg.update(block_out_channels=[64, 128, 256, 256], sample_size=64)
    vae_cfg.update(block_out_channels=[32, 32, 64, 64], layers_per_block=1)
    te_cfg.update(num_hidden_layers=2)
unet = UNet2DConditionModel(**unet_cfg).eval()
vae = AutoencoderKL(**vae_cfg).eval()
text_encoder = CLIPTextModel(CLIPTextConfig(**te_cfg)).eval()
tok_dir = os.path.join(CFG, "tokenizer")
tokenizer = CLIPTokenizer.from_pretrained(tok_dir)
scheduler = PNDMScheduler.from_pretrained(os.path.join(CFG, "scheduler"))
ids = tokenizer("a photo of a cat", padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
print(f"[make_model] size={a.size} built in {time.time() - t0:.1f}s; tokens: {ids[0, :8].tolist()}")


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from make_forge_model import randomise  # noqa: E402  (the Forge family's: norm layers and all-zero weights)

for model, name in ((unet, "unet"), (vae, "vae"), (text_encoder, "text_encoder")):
    n, zeros = randomise(model)
    print(f"[make_model] {name}: {n} norm layers perturbed, {zeros} all-zero weights re-drawn, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")

with torch.no_grad():
    ctx = text_encoder(ids).last_hidden_state
    print(f"[make_model] text hidden states {tuple(ctx.shape)} mean {ctx.mean().item():.3g} std {ctx.std().item():.3g}")
    x = torch.randn(1, 4, 16, 16)
    eps = unet(x, 500, encoder_hidden_states=ctx).sample
    s = eps.std().item()
    unet.conv_out.weight.mul_(1.0 / max(s, 1e-6))
    unet.conv_out.bias.mul_(1.0 / max(s, 1e-6))
    eps = unet(x, 500, encoder_hidden_states=ctx).sample
    print(f"[make_model] unet eps std {s:.3g} -> {eps.std().item():.3g}")
    img = vae.decode(torch.randn(1, 4, 16, 16)).sample
    s = img.std().item()
    vae.decoder.conv_out.weight.mul_(0.5 / max(s, 1e-6))
    vae.decoder.conv_out.bias.mul_(0.5 / max(s, 1e-6))
    img = vae.decode(torch.randn(1, 4, 16, 16)).sample
    print(f"[make_model] vae decode std {s:.3g} -> {img.std().item():.3g}, out {tuple(img.shape)}")

pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                               safety_checker=None, feature_extractor=None, requires_safety_checker=False)
if not a.fp32:
    pipe.to(torch.float16)
tmp = os.path.abspath(a.out) + ".tmp"
shutil.rmtree(tmp, ignore_errors=True)
pipe.save_pretrained(tmp, safe_serialization=True)
with open(os.path.join(tmp, "README.txt"), "w", encoding="utf8") as f:
    f.write(f"Random-weight SD 1.5 test model (size={a.size}, seed={a.seed}) written by the SD.Next harness of tests/real_hosts/hosts "
            f"make_model.py. Not a real model: images are noise.\n")
shutil.rmtree(a.out, ignore_errors=True)
os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
os.replace(tmp, a.out)
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(a.out) for f in fs)
print(f"[make_model] wrote {a.out} ({size / 1e6:.0f} MB) in {time.time() - t0:.0f}s")

# check: it loads back offline as a StableDiffusionPipeline and runs one tiny step
os.environ["HF_HUB_OFFLINE"] = "1"
chk = StableDiffusionPipeline.from_pretrained(a.out, torch_dtype=torch.float32, local_files_only=True)
out = chk("a photo of a cat", num_inference_steps=1, height=64, width=64, output_type="np",
          generator=torch.Generator().manual_seed(1)).images
assert out.shape == (1, 64, 64, 3) and bool((out == out).all()), out.shape
print(f"[make_model] OK: reloads as {type(chk).__name__}, unet {type(chk.unet).__name__}, 1-step 64x64 image "
      f"mean {out.mean():.3f} std {out.std():.3f}; total {time.time() - t0:.0f}s")
sys.exit(0)
