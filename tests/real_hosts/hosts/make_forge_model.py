#!/usr/bin/env python
"""Write a RANDOM-weight checkpoint with the real Stable Diffusion 1.5 layout and sizes, fully offline, for a host of
the Forge family: Forge, Forge Neo, reForge or Forge Classic. The flag that names the host also names its tree:

  python make_forge_model.py --forge $FORGE                 --out $FORGE_MODELS/Stable-diffusion/random-sd15.safetensors
  python make_forge_model.py --neo $NEO                     --out $NEO_MODELS/Stable-diffusion/random-sd15.safetensors
  python make_forge_model.py --reforge $REFORGE             --out $REFORGE_MODELS/Stable-diffusion/random-sd15.safetensors
  python make_forge_model.py --forge-classic $FCLASSIC      --out $FCLASSIC_MODELS/Stable-diffusion/random-sd15.safetensors
  [--seed 1234] [--no-check]

Run it with that host's venv python: it imports the host's own backend from the laid-out tree.

Why full size: none of these hosts reads a .yaml to build the model. Forge and Neo recognise it from tensor names
and shapes (huggingface_guess: U-Net model_channels 320, context_dim 768, no linear-in-transformer -> SD15) and build
every component from the Hugging Face configs they ship in backend/huggingface/runwayml/stable-diffusion-v1-5/;
reForge and Forge Classic pick configs/v1-inference.yaml from key names for an ldm LatentDiffusion shell, and
ldm_patched's model_detection reads the U-Net config from the shapes to build the U-Net, VAE and CLIP they run.
A width-reduced model like the A1111 harness's is recognised as no model at all.

The three parts come from the host's own classes (nothing from Hugging Face, no ldm repository):
  model.diffusion_model.*     Forge/Neo: backend.nn.unet.IntegratedUNet2DConditionModel; reForge/Forge Classic:
                              ldm_patched...openaimodel.UNetModel; the SD15 config (860M params, original LDM names)
  first_stage_model.*         backend.nn.vae.IntegratedAutoencoderKL from .../vae/config.json, or
                              ldm_patched.ldm.models.autoencoder.AutoencoderKL with SD's VAE ddconfig
  cond_stage_model.transformer.text_model.*   transformers.CLIPTextModel from .../text_encoder/config.json or
                              ldm_patched/modules/sd1_clip_config.json (ViT-L/14 text)
  + the LDM noise-schedule buffers (betas, alphas_cumprod, ...) and the int64 CLIP position_ids a real file has.
Saved as fp16 safetensors (about 2.1 GB), like v1-5-pruned-emaonly-fp16.

Where the hosts differ (HOSTS below): how the backend is told to run on the CPU before it asks torch.cuda for the
device (Forge's backend/args.py parses sys.argv at import, with --always-cpu; Neo's knows --cpu instead; reForge's
ldm_patched parses sys.argv once options.enable_args_parsing() is called; Forge Classic's parses [] at import and the
webui sets args_parser.args itself), where huggingface_guess lives (Forge: repositories/, Neo: modules_forge/packages/)
and how the written file is checked (huggingface_guess, or ldm_patched's model_detection, whose older copy in Forge
Classic takes (state_dict, prefix, dtype)).

Randomisation (see the A1111 harness notes): ldm_patched's layers skip weight initialisation (its ops leave
parameters torch.empty), so there every layer is re-initialised with its torch.nn base class's reset_parameters.
Then every LayerNorm/GroupNorm affine param gets 1+0.1*N / 0.1*N (weight=1, bias=0 make the random CLIP's output
mean exactly zero and the 'original' emphasis divides by it -> NaN); any all-zero weight tensor gets N(0, 0.02); the
U-Net's last conv is scaled so eps has std ~1 and the VAE decoder's last conv so decoded pixels have std ~0.5
(visible structure, not a saturated image). Images are noise-like, not art.
"""
import argparse
import os
import sys
import time

# host flag -> label, backend family, the flag that keeps the backend on the CPU, huggingface_guess's folder
HOSTS = {
    "forge": ("Forge", "backend", "--always-cpu", ("repositories", "huggingface_guess")),
    "neo": ("Forge Neo", "backend", "--cpu", ("modules_forge", "packages")),
    "reforge": ("reForge", "ldm_patched", "--always-cpu", None),
    "forge_classic": ("Forge Classic", "ldm_patched", "--always-cpu", None),
}
# huggingface_guess/detection.py SD15 + model_list.SD15.unet_extra_config (num_heads 8); ldm_patched's
# model_detection.detect_unet_config answers the same, plus its two temporal keys
SD15_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1,
    "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8, "num_head_channels": -1,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
}
SD15_UNET_LDM_PATCHED = {**SD15_UNET, "use_temporal_resblock": False, "use_temporal_attention": False}
VAE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


def import_backend(host, tree):
    """Put the host's tree on sys.path and have its backend run on the CPU (before anything imports torch.cuda)."""
    _, family, cpu_flag, hf_guess = HOSTS[host]
    sys.argv = [sys.argv[0], cpu_flag]
    if family == "backend":
        sys.path.insert(0, os.path.join(tree, *hf_guess))
        sys.path.insert(0, tree)
        # gguf (backend.utils imports it), as modules_forge/initialization.py does (Forge only; Neo has no such folder)
        sys.path.insert(0, os.path.join(tree, "packages_3rdparty"))
        import backend.args  # parses sys.argv, once

        assert getattr(backend.args.args, cpu_flag.lstrip("-").replace("-", "_")), backend.args.args
        return
    sys.path.insert(0, tree)
    import ldm_patched.modules.options

    ldm_patched.modules.options.enable_args_parsing()
    if host == "forge_classic":
        from ldm_patched.modules import args_parser

        args_parser.args, _ = args_parser.parser.parse_known_args([cpu_flag])


def torch_init(model):
    """Re-initialise every layer with torch's default init (ldm_patched's ops leave parameters uninitialised).
    Parameters are NaN-filled first, so one that no reset_parameters reached fails the check below."""
    import torch

    with torch.no_grad():
        for prm in model.parameters():
            prm.fill_(float("nan"))
        n = 0
        for mod in model.modules():
            for cls in type(mod).__mro__:
                if cls.__module__.startswith("torch.nn.modules") and "reset_parameters" in cls.__dict__:
                    cls.reset_parameters(mod)
                    n += 1
                    break
    bad = [name for name, prm in model.named_parameters() if not torch.isfinite(prm).all()]
    assert not bad, f"parameters no torch init reached: {bad[:5]}"
    return n


def build_backend(tree):
    """U-Net, VAE, CLIP text encoder and tokenizer from Forge's (and Neo's) backend classes and shipped configs."""
    from backend.nn.unet import IntegratedUNet2DConditionModel
    from backend.nn.vae import IntegratedAutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    hf = os.path.join(tree, "backend", "huggingface", "runwayml", "stable-diffusion-v1-5")
    unet = IntegratedUNet2DConditionModel.from_config(SD15_UNET).eval()
    vae = IntegratedAutoencoderKL.from_config(IntegratedAutoencoderKL.load_config(os.path.join(hf, "vae"))).eval()
    clip = CLIPTextModel(CLIPTextConfig.from_pretrained(os.path.join(hf, "text_encoder"))).eval()
    return unet, vae, clip, CLIPTokenizer.from_pretrained(os.path.join(hf, "tokenizer")), ""


def build_ldm_patched(tree):
    """The same parts from ldm_patched's classes (reForge, Forge Classic), re-initialised with torch's default init."""
    import torch
    from ldm_patched.ldm.models.autoencoder import AutoencoderKL
    from ldm_patched.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    class TorchOps:
        """The `operations` namespace ldm_patched's U-Net takes, with plain torch layers (initialised as usual)."""
        Linear, Conv1d, Conv2d, Conv3d = torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d
        GroupNorm, LayerNorm, Embedding = torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.Embedding
        ConvTranspose2d, ConvTranspose1d = torch.nn.ConvTranspose2d, torch.nn.ConvTranspose1d

        @classmethod
        def conv_nd(cls, dims, *a, **kw):
            return {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dims](*a, **kw)

    unet = UNetModel(**SD15_UNET_LDM_PATCHED, dtype=torch.float32, device="cpu", operations=TorchOps).eval()
    torch_init(unet)
    vae = AutoencoderKL(ddconfig=VAE_DDCONFIG, embed_dim=4).eval()
    n_vae_init = torch_init(vae)
    ldmp = os.path.join(tree, "ldm_patched", "modules")
    clip = CLIPTextModel(CLIPTextConfig.from_json_file(os.path.join(ldmp, "sd1_clip_config.json"))).eval()
    tok = CLIPTokenizer.from_pretrained(os.path.join(ldmp, "sd1_tokenizer"))
    return unet, vae, clip, tok, f" (vae layers re-initialised: {n_vae_init})"


def randomise(model):
    """Give every LayerNorm/GroupNorm affine param 1+0.1*N / 0.1*N and every all-zero weight tensor N(0, 0.02);
    returns (norm layers, all-zero tensors). Also the SD.Next harness's (sdnext/make_model.py)."""
    import torch

    n_norm = n_zero = 0
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (torch.nn.LayerNorm, torch.nn.GroupNorm)) and getattr(mod, "weight", None) is not None:
                mod.weight.copy_(1.0 + 0.1 * torch.randn_like(mod.weight))
                if mod.bias is not None:
                    mod.bias.copy_(0.1 * torch.randn_like(mod.bias))
                n_norm += 1
        for _, prm in model.named_parameters():
            if prm.dim() > 1 and torch.count_nonzero(prm) == 0:
                torch.nn.init.normal_(prm, std=0.02)
                n_zero += 1
    for pn, prm in model.named_parameters():
        assert torch.isfinite(prm).all(), f"{pn} is not finite (uninitialised?)"
    return n_norm, n_zero


def decoded(img):
    return img if isinstance(img, __import__("torch").Tensor) else img.sample


def calibrate(unet, vae, clip, tok):
    """Scale the U-Net's last conv so eps has std ~1 and the VAE decoder's so pixels have std ~0.5."""
    import torch

    with torch.no_grad():
        # CLIP sanity: the hidden states the webui uses must not have a zero mean (emphasis divides by it)
        ids = torch.tensor([tok("a photo of a cat", padding="max_length", max_length=77)["input_ids"]])
        hs = clip(ids, output_hidden_states=True).last_hidden_state
        print(f"clip last_hidden_state mean {hs.mean().item():.4g} std {hs.std().item():.4g}")

        x = torch.randn(1, 4, 32, 32)
        ts = torch.tensor([500.0])
        ctx = hs.float()
        s = unet(x, ts, ctx, transformer_options={}).std().item()
        last = unet.out[-1]
        last.weight.mul_(1.0 / max(s, 1e-6))
        last.bias.mul_(1.0 / max(s, 1e-6))
        out = unet(x, ts, ctx, transformer_options={})
        print(f"unet eps std raw {s:.4g} -> {out.std().item():.4g} (latent 32x32)")

        # the webui clamps decoded pixels to [-1, 1]
        z = torch.randn(1, 4, 32, 32)
        s = decoded(vae.decode(z)).std().item()
        vae.decoder.conv_out.weight.mul_(0.5 / max(s, 1e-6))
        vae.decoder.conv_out.bias.mul_(0.5 / max(s, 1e-6))
        img = decoded(vae.decode(z))
        print(f"vae decode std raw {s:.4g} -> {img.std().item():.4g} (mean {img.mean().item():.3g})")


def state_dict(unet, vae, clip):
    """The checkpoint's tensors (fp16 but for the int64 position_ids), with the LDM DDPM buffers of real SD1.x files
    (scaled-linear betas 0.00085..0.012, 1000 steps)."""
    import torch

    sd = {"model.diffusion_model." + k: v for k, v in unet.state_dict().items()}
    sd.update({"first_stage_model." + k: v for k, v in vae.state_dict().items()})
    sd.update({"cond_stage_model.transformer." + k: v for k, v in clip.state_dict().items()
               if not k.endswith("position_ids")})
    sd["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch.arange(77, dtype=torch.int64)[None]
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    ac = torch.cumprod(1.0 - betas, 0)
    ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
    post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
    sd.update({
        "betas": betas, "alphas_cumprod": ac, "alphas_cumprod_prev": ac_prev,
        "sqrt_alphas_cumprod": ac.sqrt(), "sqrt_one_minus_alphas_cumprod": (1 - ac).sqrt(),
        "log_one_minus_alphas_cumprod": (1 - ac).log(), "sqrt_recip_alphas_cumprod": (1 / ac).sqrt(),
        "sqrt_recipm1_alphas_cumprod": (1 / ac - 1).sqrt(), "posterior_variance": post_var,
        "posterior_log_variance_clipped": torch.log(torch.clamp(post_var, min=1e-20)),
        "posterior_mean_coef1": betas * ac_prev.sqrt() / (1 - ac),
        "posterior_mean_coef2": (1 - ac_prev) * (1 - betas).sqrt() / (1 - ac),
    })
    sd = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).contiguous() for k, v in sd.items()}
    for k, v in sd.items():
        assert torch.isfinite(v.float()).all(), k
    return sd


def check(host, path):
    """The host's own model detection must take the file for SD 1.5."""
    import torch
    from safetensors.torch import safe_open

    with safe_open(path, "pt") as f:
        chk = {k: f.get_tensor(k) for k in f.keys()}
    if HOSTS[host][1] == "backend":
        import huggingface_guess

        g = huggingface_guess.guess(chk)
        print("huggingface_guess:", type(g).__name__, g.huggingface_repo, "unet_config context_dim",
              g.unet_config.get("context_dim"))
        assert type(g).__name__ == "SD15", type(g)
    else:
        from ldm_patched.modules import model_detection

        if hasattr(model_detection, "unet_prefix_from_state_dict"):  # newer ldm_patched (reForge)
            prefix = model_detection.unet_prefix_from_state_dict(chk)
            cfg = model_detection.model_config_from_unet(chk, prefix)
        else:  # Forge Classic's older ComfyUI copy: model_config_from_unet(state_dict, prefix, dtype)
            prefix = "model.diffusion_model."
            cfg = model_detection.model_config_from_unet(chk, prefix, torch.float16)
        print("ldm_patched model_detection:", type(cfg).__name__, "prefix", prefix,
              "context_dim", cfg.unet_config.get("context_dim") if cfg else None)
        assert type(cfg).__name__ == "SD15", type(cfg)
        want = SD15_UNET_LDM_PATCHED
        unknown = [k for k in want if cfg.unet_config.get(k, want[k]) != want[k]]
        assert not unknown, f"detected U-Net config differs from the one built: {unknown}"
    print("OK: recognised as SD15")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree = p.add_mutually_exclusive_group(required=True)
    tree.add_argument("--forge", metavar="TREE", help="Forge source tree (backend/, repositories/huggingface_guess)")
    tree.add_argument("--neo", metavar="TREE", help="Forge Neo source tree (backend/, modules_forge/packages/)")
    tree.add_argument("--reforge", metavar="TREE", help="reForge source tree (ldm_patched/, modules/, configs/)")
    tree.add_argument("--forge-classic", metavar="TREE", help="Forge Classic source tree (ldm_patched/, modules/)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-check", action="store_true", help="skip the check with the host's own model detection")
    args = p.parse_args()
    host = next(h for h in HOSTS if getattr(args, h) is not None)
    label, family = HOSTS[host][:2]
    root = os.path.abspath(getattr(args, host))
    import_backend(host, root)

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(args.seed)
    t0 = time.time()
    unet, vae, clip, tok, note = (build_backend if family == "backend" else build_ldm_patched)(root)
    print(f"built modules in {time.time() - t0:.1f}s{note}; tokenizer check:", tok("a photo of a cat")["input_ids"])
    for model, name in ((unet, "unet"), (vae, "vae"), (clip, "clip")):
        print("{}: randomised {} norm layers, {} all-zero weight tensors".format(name, *randomise(model)))
    calibrate(unet, vae, clip, tok)
    sd = state_dict(unet, vae, clip)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    save_file(sd, tmp, metadata={"format": "pt", "note": f"random-weight SD1.5-layout test model ({label} harness)"})
    os.replace(tmp, args.out)
    n = {part: sum(v.numel() for k, v in sd.items() if k.startswith(prefix)) / 1e6 for part, prefix in
         (("unet", "model.diffusion_model."), ("vae", "first_stage_model."), ("clip", "cond_stage_model."))}
    print(f"wrote {args.out}: {len(sd)} tensors, unet {n['unet']:.1f}M + vae {n['vae']:.1f}M + clip {n['clip']:.1f}M "
          f"params, {os.path.getsize(args.out) / 1e9:.2f} GB, {time.time() - t0:.0f}s")
    del sd, unet, vae, clip
    if not args.no_check:
        check(host, args.out)


if __name__ == "__main__":
    main()
