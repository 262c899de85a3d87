"""Measuring what token merging gains on this machine: ``python -m tome_core.bench --help`` and
``python -m tome_core.gpucheck``.

A tool for users of the engine, kept apart from it: it builds the webui's ldm U-Nets and imports ``ldm`` (and,
when installed, ``tomesd``, ``tqdm``, ``matplotlib``) while it runs; checkpoints are read without the
``safetensors`` package. Importing this package imports none of them, and the engine (the rest of
``tome_core``) never imports this package.

Modules, by concern (each imports only those listed before it):
    archs       the webui's U-Net architectures with SDP attention, random weights, any width scale; the adapters
                that call a deep-stack ldm U-Net or a diffusers one as the benchmark calls ldm's
    pipeline    what a fidelity run samples with: U-Net, empty-prompt conditioning, schedule, decoder
    sampling    a short deterministic Euler run on a pipeline
    textenc     a checkpoint's text encoders (CLIP ViT-L, OpenCLIP ViT-H/bigG) for the empty prompt
    vae         a checkpoint's VAE decoder
    tensorfile  a checkpoint file's tensors, read a part at a time (safetensors or pickle), and the one-line
                refusal of a file it cannot use
    checkpoint  a real checkpoint read off its tensors: its U-Net, or the whole model as a pipeline
    diffusers_folder  a diffusers model folder as a pipeline
    contenders  what is raced: none, ToMe, ToDo, Local, Stack, tomesd at each setting, and the ideals (attention
                on fewer tokens, chosen free; every query on fewer keys and values; or whole stacks on fewer
                tokens)
    timing      interleaved rounds, medians and spreads, the cores other processes take, the GPU's busy time
                per call, a progress bar
    metrics     PSNR and SSIM of pictures in [0, 1]
    spread      a figure over images or models: each value, the median, the range
    macs        multiply-adds a call computes
    opcount     operations a patched transformer block dispatches
    report      markdown tables (speed, share of the ideal's gain, PSNR, SSIM, step dB, ops per block, one line
                per method and setting) and the busy-machine warning
    stepwise    one step's prediction with each contender along the unmerged run's own trajectory
    fidelity    the same sampling run with each contender, pictures compared image by image with the unmerged
    replicate   the same figures on several proxies: each one's, their median, the orderings that hold on all
    sheet       the pictures side by side (rows: methods, columns: settings, the unmerged first) and their
                amplified differences
    chart       speed-up against PSNR and step dB per method and setting (speed-ups alone for random weights)
    probes      the merge's own cost: time and peak memory of find + merge + unmerge
    jobs        the measurements: a whole U-Net step, one top transformer, a trained model's speed and fidelity
    proxy       the shipped proxy models (small pixel-space U-Nets trained on photographs from three seeds) for
                fidelity runs without a checkpoint: their layouts, building one, ``load_proxy()``
    proxy.training  how the proxies were made: the photographs, the crops, the training loop, the saved file
    proxy.__main__  ``python -m tome_core.bench.proxy train|samples``
    weights/    the shipped proxies' weight files: the repository's, left out of the engine's wheel
    arguments   the command line's parser, the validation of its arguments, the one-line refusal (UsageError)
    loading     the device, and the trained models to measure (checkpoint, diffusers folder, proxies), each
                checked against the sizes it is run at
    runs        the two kinds of run (trained models: speed and fidelity; architectures: speed only) and the
                lines that close them (load, busy-machine warning)
    cli         ``main()``: ``python -m tome_core.bench``
    runtime     a whole sampling run's speed for a method whose calls differ (Cache: full and reused calls
                counted and each kind timed; ``python -m tome_core.bench.runtime``)
    samplers    final-picture fidelity per proxy and sampler (``python -m tome_core.bench.samplers``)
    gpucheck    the one-call GPU check (``python -m tome_core.gpucheck``)
"""
