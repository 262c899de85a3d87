#!/usr/bin/env python
"""Create a TINY random-weight SD1-architecture checkpoint for A1111, fully offline.

Writes:
  <out>/tiny-clip/                     CLIP tokenizer (real CLIP BPE vocab, derived from open_clip's
                                       bundled bpe_simple_vocab_16e6.txt.gz) + tiny CLIPTextConfig + weights
  <out>/Stable-diffusion/tiny-sd1.yaml  v1-inference.yaml structure with small widths; cond_stage_config
                                       points FrozenCLIPEmbedder(version=<out>/tiny-clip)
  <out>/Stable-diffusion/tiny-sd1.safetensors  full LatentDiffusion state dict (fp32), incl. CLIP weights
  <hf_home>/hub/models--openai--clip-vit-large-patch14/...  the same tokenizer + config in HF cache
                                       layout, so code asking for 'openai/clip-vit-large-patch14'
                                       also resolves offline (HF_HOME=<hf_home>, HF_HUB_OFFLINE=1).

Run with the A1111 venv python:
  python make_tiny_model.py --webui $WEBUI --out $A1111_MODELS --hf-home $HF_HOME   (the names of env.sh)
"""
import argparse
import gzip
import json
import os
import shutil
import sys

p = argparse.ArgumentParser()
p.add_argument("--webui", required=True)
p.add_argument("--out", required=True)
p.add_argument("--hf-home", required=True)
p.add_argument("--context-dim", type=int, default=768, help="CLIP hidden size == UNet context_dim (SD1 uses 768)")
p.add_argument("--clip-layers", type=int, default=2)
p.add_argument("--clip-heads", type=int, default=4)
p.add_argument("--model-channels", type=int, default=32)
p.add_argument("--vae-ch", type=int, default=32)
p.add_argument("--seed", type=int, default=1234)
args = p.parse_args()

sys.path.insert(0, os.path.join(args.webui, "repositories/stable-diffusion-stability-ai"))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

torch.manual_seed(args.seed)

clip_dir = os.path.join(args.out, "tiny-clip")
sd_dir = os.path.join(args.out, "Stable-diffusion")
os.makedirs(clip_dir, exist_ok=True)
os.makedirs(sd_dir, exist_ok=True)

# ---------------------------------------------------------------- tokenizer files (real CLIP BPE)
import open_clip.tokenizer as oct  # noqa: E402

bpe_path = oct.default_bpe()
merges = gzip.open(bpe_path).read().decode("utf-8").split("\n")
merges = merges[1:49152 - 256 - 2 + 1]
merges = [tuple(m.split()) for m in merges]
vocab = list(oct.bytes_to_unicode().values())
vocab = vocab + [v + "</w>" for v in vocab]
for m in merges:
    vocab.append("".join(m))
vocab.extend(["<|startoftext|>", "<|endoftext|>"])
encoder = {t: i for i, t in enumerate(vocab)}
assert len(encoder) == 49408, len(encoder)

with open(os.path.join(clip_dir, "vocab.json"), "w", encoding="utf-8") as f:
    json.dump(encoder, f, ensure_ascii=False)
with open(os.path.join(clip_dir, "merges.txt"), "w", encoding="utf-8") as f:
    f.write("#version: 0.2\n")
    f.write("\n".join(" ".join(m) for m in merges))
    f.write("\n")
special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
with open(os.path.join(clip_dir, "special_tokens_map.json"), "w") as f:
    json.dump(special, f, indent=2)
with open(os.path.join(clip_dir, "tokenizer_config.json"), "w") as f:
    json.dump({
        **special,
        "add_prefix_space": False,
        "errors": "replace",
        "do_lower_case": True,
        "model_max_length": 77,
        "tokenizer_class": "CLIPTokenizer",
    }, f, indent=2)

H = args.context_dim
clip_config = {
    "architectures": ["CLIPTextModel"],
    "model_type": "clip_text_model",
    "vocab_size": 49408,
    "hidden_size": H,
    "intermediate_size": 4 * H,
    "projection_dim": H,
    "num_hidden_layers": args.clip_layers,
    "num_attention_heads": args.clip_heads,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "initializer_range": 0.02,
    "initializer_factor": 1.0,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 49407,
    "torch_dtype": "float32",
}
with open(os.path.join(clip_dir, "config.json"), "w") as f:
    json.dump(clip_config, f, indent=2)

# random CLIP text weights inside the tiny-clip dir so FrozenCLIPEmbedder(version=dir) can be built here
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer  # noqa: E402

clip = CLIPTextModel(CLIPTextConfig(**clip_config))
clip.save_pretrained(clip_dir, safe_serialization=True)
tok = CLIPTokenizer.from_pretrained(clip_dir)
ids = tok("a photo of a cat, dog")["input_ids"]
print("tokenizer check:", ids, tok.convert_ids_to_tokens(ids))
assert ids[0] == 49406 and ids[-1] == 49407

# ---------------------------------------------------------------- HF cache copy for 'openai/clip-vit-large-patch14'
snap_hash = "0000000000000000000000000000000000tiny01"
repo_cache = os.path.join(args.hf_home, "hub", "models--openai--clip-vit-large-patch14")
snap = os.path.join(repo_cache, "snapshots", snap_hash)
os.makedirs(snap, exist_ok=True)
os.makedirs(os.path.join(repo_cache, "refs"), exist_ok=True)
with open(os.path.join(repo_cache, "refs", "main"), "w") as f:
    f.write(snap_hash)
for fn in ["vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json", "config.json"]:
    shutil.copy(os.path.join(clip_dir, fn), os.path.join(snap, fn))

# ---------------------------------------------------------------- yaml (v1-inference structure, small widths)
yaml_text = f"""model:
  base_learning_rate: 1.0e-04
  target: ldm.models.diffusion.ddpm.LatentDiffusion
  params:
    linear_start: 0.00085
    linear_end: 0.0120
    num_timesteps_cond: 1
    log_every_t: 200
    timesteps: 1000
    first_stage_key: "jpg"
    cond_stage_key: "txt"
    image_size: 64
    channels: 4
    cond_stage_trainable: false
    conditioning_key: crossattn
    monitor: val/loss_simple_ema
    scale_factor: 0.18215
    use_ema: False

    scheduler_config:
      target: ldm.lr_scheduler.LambdaLinearScheduler
      params:
        warm_up_steps: [ 10000 ]
        cycle_lengths: [ 10000000000000 ]
        f_start: [ 1.e-6 ]
        f_max: [ 1. ]
        f_min: [ 1. ]

    unet_config:
      target: ldm.modules.diffusionmodules.openaimodel.UNetModel
      params:
        image_size: 32 # unused
        in_channels: 4
        out_channels: 4
        model_channels: {args.model_channels}
        attention_resolutions: [ 4, 2, 1 ]
        num_res_blocks: 2
        channel_mult: [ 1, 2, 4, 4 ]
        num_heads: 2
        use_spatial_transformer: True
        transformer_depth: 1
        context_dim: {H}
        use_checkpoint: False
        legacy: False

    first_stage_config:
      target: ldm.models.autoencoder.AutoencoderKL
      params:
        embed_dim: 4
        monitor: val/rec_loss
        ddconfig:
          double_z: true
          z_channels: 4
          resolution: 256
          in_channels: 3
          out_ch: 3
          ch: {args.vae_ch}
          ch_mult:
          - 1
          - 1
          - 1
          - 1
          num_res_blocks: 1
          attn_resolutions: []
          dropout: 0.0
        lossconfig:
          target: torch.nn.Identity

    cond_stage_config:
      target: ldm.modules.encoders.modules.FrozenCLIPEmbedder
      params:
        version: {os.path.abspath(clip_dir)}
"""
yaml_path = os.path.join(sd_dir, "tiny-sd1.yaml")
with open(yaml_path, "w") as f:
    f.write(yaml_text)

# ---------------------------------------------------------------- instantiate + randomize + save
from ldm.util import instantiate_from_config  # noqa: E402

cfg = OmegaConf.load(yaml_path)
model = instantiate_from_config(cfg.model)
model.eval()

# ldm zero-initialises some output projections (zero_module); give them small random values so that the
# UNet output actually depends on the latent and the text conditioning.
with torch.no_grad():
    for name, prm in model.model.diffusion_model.named_parameters():
        if prm.dim() > 1 and torch.count_nonzero(prm) == 0:
            torch.nn.init.normal_(prm, std=0.02)

    # Norm layers init to weight=1/bias=0. With random weights that makes CLIP's final LayerNorm output have an
    # exact zero mean, and A1111's "Original" emphasis divides by z.mean() -> 0/0 -> NaN (seen with 1 torch thread).
    # Real checkpoints have non-trivial norm affine params, so randomise them a little everywhere.
    for mod in model.modules():
        if isinstance(mod, (torch.nn.LayerNorm, torch.nn.GroupNorm)) and getattr(mod, "weight", None) is not None:
            mod.weight.copy_(1.0 + 0.1 * torch.randn_like(mod.weight))
            mod.bias.copy_(0.1 * torch.randn_like(mod.bias))

    # scale the final UNet conv so eps predictions have ~unit std
    unet = model.model.diffusion_model
    x = torch.randn(1, 4, 32, 32)
    t = torch.tensor([500])
    ctx = torch.randn(1, 77, H)
    out = unet(x, t, context=ctx)
    s = out.std().item()
    print("raw unet out std", s)
    last = unet.out[-1]
    last.weight.mul_(1.0 / max(s, 1e-6))
    last.bias.mul_(1.0 / max(s, 1e-6))
    print("scaled unet out std", unet(x, t, context=ctx).std().item())

sd = {k: v.detach().contiguous().float() for k, v in model.state_dict().items()}
# CLIP position_ids buffer is not a weight; keep only float tensors, the ids are rebuilt by transformers
sd = {k: v for k, v in sd.items() if not k.endswith("embeddings.position_ids")}
ckpt_path = os.path.join(sd_dir, "tiny-sd1.safetensors")
save_file(sd, ckpt_path, metadata={"format": "pt", "note": "tiny random-weight SD1 test model"})
nparams = sum(v.numel() for v in sd.values())
print(f"wrote {ckpt_path}: {len(sd)} tensors, {nparams/1e6:.2f}M params, {os.path.getsize(ckpt_path)/1e6:.1f} MB")
print(f"wrote {yaml_path}")
print(f"tokenizer/config dir {clip_dir}; HF cache {repo_cache}")
