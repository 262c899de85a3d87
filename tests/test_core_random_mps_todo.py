"""Seeded partitions, the MPS-safe int32 path, ToDo and input validation."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tome_core
from tome_core import partition as part
from unets import LatentModel, hook_counts, inputs, run, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")


# -- reproducible randomness ------------------------------------------------------------------------------

def test_same_seed_is_bitwise_reproducible_and_ignores_global_rng():
    unet = tiny_unet()
    x, t, c = inputs()
    tome_core.apply_patch(unet, ratio=0.5, seed=1234)
    first = run(unet, x, t, c)
    torch.manual_seed(99)
    torch.rand(1000)
    second = run(unet, x, t, c)
    assert torch.equal(first, second)
    tome_core.apply_patch(unet, ratio=0.5, seed=1235)
    assert not torch.equal(run(unet, x, t, c), first)
    tome_core.apply_patch(unet, ratio=0.5, seed=None)
    default = run(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.5, seed=0)
    assert torch.equal(run(unet, x, t, c), default)


def test_partition_depends_on_timestep_and_block():
    unet = tiny_unet()
    x, t, c = inputs()
    tome_core.apply_patch(unet, ratio=0.5, seed=7)
    a = run(unet, x, t, c)
    b = run(unet, x, t + 0.25, c)  # continuous timesteps: 749.25 vs 749.5
    assert not torch.equal(a, b)
    key_a, key_b = part.host_key(7, 0), part.host_key(7, 1)
    tb = part.timestep_words(torch.tensor([749.25]), torch.device("cpu"))
    assert not torch.equal(part.cell_choices(key_a, tb, 256, 4), part.cell_choices(key_b, tb, 256, 4))


def test_cond_and_uncond_stacked_equal_separate_calls_any_batch():
    """The partition is shared by every row of a call, so splitting cond/uncond (long prompts,
    batch_cond_uncond off) changes nothing; odd batches keep the random partition."""
    unet = tiny_unet()
    x, t, c = inputs(batch=3)
    tome_core.apply_patch(unet, ratio=0.5, seed=42)
    stacked = run(unet, x, t, c)
    separate = torch.cat([run(unet, x[i:i + 1], t[i:i + 1], c[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(separate, stacked, rtol=1e-5, atol=1e-6)
    tome_core.apply_patch(unet, ratio=0.5, use_rand=False)
    assert not torch.allclose(run(unet, x[:1], t[:1], c[:1]), stacked[:1], atol=1e-5)


def _python_choices(host, t: float, num_cells, cell_size):
    """The partition hash in plain Python integers: what any device must produce bit for bit."""
    bits = int.from_bytes(torch.tensor([t], dtype=torch.float32).numpy().tobytes(), "little", signed=True)
    lo, hi = bits % 32768, (bits // 32768) % part._P
    key = part._mix(part._mix(host, lo), hi)
    out = []
    for cell in range(num_cells):
        v = part._mix(part._mix(key, cell % part._P), cell // part._P)
        out.append(part._mix(v, 1) % cell_size)
    return out


@pytest.mark.parametrize("seed,t", [(0, 999.0), (123456789, 749.25), (2 ** 63 + 5, 1.0), (-1, 0.0)])
def test_partition_is_exact_integer_arithmetic(seed, t):
    """Every intermediate stays below 2**31, so int32 tensor arithmetic equals unbounded Python integers:
    the same partition on CPU, CUDA or MPS."""
    host = part.host_key(seed, 3)
    got = part.cell_choices(host, part.timestep_words(torch.tensor([t]), torch.device("cpu")), 600, 4)
    assert got.dtype == torch.int32
    assert got.tolist() == _python_choices(host, t, 600, 4)
    assert max(part._P - 1, part._MULT) * (part._P - 1) + part._P < 2 ** 31


def test_partition_is_valid_and_uniform():
    h, w, sx, sy = 30, 21, 2, 3
    cells = (h // sy) * (w // sx)
    choice = part.cell_choices(part.host_key(5, 0), part.timestep_words(torch.tensor([500.0]),
                                                                        torch.device("cpu")), cells, sx * sy)
    for dtype in (torch.int32, torch.int64):
        src, dst = part.partition(h, w, sx, sy, choice, dtype)
        assert src.dtype == dst.dtype == dtype
        assert sorted(torch.cat([src, dst]).tolist()) == list(range(h * w))
        ys, xs = dst // w, dst % w
        cell_ids = ((ys // sy) * (w // sx) + xs // sx).tolist()
        assert sorted(cell_ids) == list(range(cells))  # one destination per cell
    counts = torch.bincount(choice.long(), minlength=sx * sy).float()
    expected = cells / (sx * sy)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25  # 5 degrees of freedom: p ≈ 1e-4
    src, dst = part.fixed_partition(h, w, sx, sy, torch.device("cpu"), torch.int64)
    assert all((d // w) % sy == 0 and (d % w) % sx == 0 for d in dst.tolist())  # top-left of each cell


# -- MPS-safe int32 path -----------------------------------------------------------------------------------

class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


INDEX_OPS = {"gather", "scatter", "scatter_add", "index_select", "index_add", "index_put", "index_copy",
             "index_fill", "take", "index"}
ARITHMETIC = {"add", "sub", "rsub", "mul", "div", "remainder", "fmod", "floor_divide", "neg", "pow",
              "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "abs"}
SORTS = {"sort", "argsort", "topk", "msort", "kthvalue"}


def violations(calls):
    bad = []
    for func, args, kwargs in calls:
        name = func.overloadpacket.__name__.rstrip("_")
        if name == "scatter_reduce":
            bad.append(f"{func}: scatter_reduce")
        if name in INDEX_OPS:
            index_args = args[1] if name in ("index_put", "index") else args[2] if len(args) > 2 else None
            for idx in _tensors([index_args]):
                if idx.dtype not in (torch.int32, torch.bool):
                    bad.append(f"{func}: index dtype {idx.dtype}")
            if name == "gather" and args[2].shape[-1] == 1:
                bad.append(f"{func}: gather with last dimension 1")
        if name in ARITHMETIC and any(t.dtype == torch.int64 for t in _tensors(list(args) + list(kwargs.values()))):
            bad.append(f"{func}: int64 arithmetic")
        if name in SORTS and any(t.dtype == torch.int64 for t in _tensors(args[:1])):
            bad.append(f"{func}: int64 sort")
    return bad


@pytest.mark.parametrize("use_rand", [True, False])
def test_int32_path_obeys_mps_rules_and_equals_int64(use_rand):
    unet = tiny_unet()
    x, t, c = inputs(batch=2, h=24, w=40)
    opts = dict(ratio=0.5, use_rand=use_rand, merge_crossattn=True, merge_mlp=True, max_downsample=2, seed=3)
    tome_core.apply_patch(unet, index_dtype=torch.int64, **opts)
    wide = run(unet, x, t, c)
    tome_core.apply_patch(unet, index_dtype=torch.int32, **opts)
    part.fixed_partition.cache_clear()
    part._grid_layout.cache_clear()
    with OpRecorder() as rec, torch.no_grad():
        narrow = unet(x, t, context=c)
    assert torch.equal(narrow, wide)
    names = {f.overloadpacket.__name__ for f, _, _ in rec.calls}
    assert {"index_add_", "index_select"} <= names, "the merge did not run under the recorder"
    assert violations(rec.calls) == []


def test_recorder_catches_the_int64_path():
    """The rule check is not vacuous: the int64 path breaks it."""
    unet = tiny_unet()
    x, t, c = inputs()
    tome_core.apply_patch(unet, ratio=0.5, index_dtype=torch.int64)
    with OpRecorder() as rec, torch.no_grad():
        unet(x, t, context=c)
    assert any("index dtype torch.int64" in v for v in violations(rec.calls))


def test_index_dtype_is_int32_on_mps_only():
    from tome_core.methods.base import default_index_dtype

    assert default_index_dtype(torch.device("mps")) == torch.int32
    assert default_index_dtype(torch.device("cpu")) == torch.int64
    assert default_index_dtype(torch.device("cuda")) == torch.int64


# -- ToDo -------------------------------------------------------------------------------------------------

def explicit_downsample(tokens, h, w, f, pool):
    """Keys/values of ToDo written out window by window."""
    rows = []
    for i in range(0, h, f):
        for j in range(0, w, f):
            if pool == "nearest":
                rows.append(tokens[:, i * w + j])
            else:
                window = [tokens[:, y * w + x] for y in range(i, min(i + f, h)) for x in range(j, min(j + f, w))]
                rows.append(torch.stack(window, 0).mean(0))
    return torch.stack(rows, 1)


@pytest.mark.parametrize("pool", ["nearest", "average"])
@pytest.mark.parametrize("factor,h,w", [(2, 16, 16), (2, 9, 7), (3, 10, 8)])
def test_todo_equals_attention_on_downsampled_keys_and_values(pool, factor, h, w):
    unet = tiny_unet("sd1")
    transformer = unet.input_blocks[1][1]
    blk = transformer.transformer_blocks[0]
    x = torch.randn(2, 32, h, w)
    c = torch.randn(2, 7, 24)
    seen = {}
    blk.register_forward_hook(lambda m, a, out: seen.update(inp=a[0], out=out))
    tome_core.apply_patch(transformer, method="todo", todo_factor=factor, todo_pool=pool)
    with torch.no_grad():
        transformer(x, context=c)
        xin = seen["inp"]
        n1 = blk.norm1(xin)
        e = blk.attn1(n1, context=explicit_downsample(n1, h, w, factor, pool)) + xin
        e = blk.attn2(blk.norm2(e), context=c) + e
        e = blk.ff(blk.norm3(e)) + e
        full = blk.attn1(n1) + xin
        full = blk.attn2(blk.norm2(full), context=c) + full
        full = blk.ff(blk.norm3(full)) + full
    torch.testing.assert_close(seen["out"], e, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(seen["out"], full, atol=1e-4), "ToDo changed nothing: the case proves nothing"
    assert explicit_downsample(n1, h, w, factor, pool).shape[1] == math.ceil(h / factor) * math.ceil(w / factor)


def test_todo_factor_one_is_noop():
    unet = tiny_unet()
    x, t, c = inputs()
    base = run(unet, x, t, c)
    tome_core.apply_patch(unet, method="todo", todo_factor=1)
    assert torch.equal(run(unet, x, t, c), base)


# -- bad input --------------------------------------------------------------------------------------------

BAD = [
    (dict(ratio=1.0), ValueError, "ratio"), (dict(ratio=-0.1), ValueError, "ratio"),
    (dict(ratio="0.5"), TypeError, "ratio"), (dict(ratio=float("nan")), ValueError, "ratio"),
    (dict(ratio=True), TypeError, "ratio"), (dict(sx=0), ValueError, "sx"), (dict(sy=1.5), TypeError, "sy"),
    (dict(sx=9), ValueError, "sx"), (dict(max_downsample=3), ValueError, "max_downsample"),
    (dict(max_downsample=16), ValueError, "max_downsample"), (dict(method="fast"), ValueError, "method"),
    (dict(todo_pool="max"), ValueError, "todo_pool"), (dict(todo_factor=0), ValueError, "todo_factor"),
    (dict(index_dtype=torch.int16), ValueError, "index_dtype"), (dict(use_rand="yes"), TypeError, "use_rand"),
    (dict(merge_mlp=1), TypeError, "merge_mlp"), (dict(seed="1"), TypeError, "seed"),
    (dict(step_start=0.8, step_end=0.2), ValueError, "step_start"), (dict(step_end=1.2), ValueError, "step_end"),
]


@pytest.mark.parametrize("kwargs,exc,name", BAD)
def test_bad_options_are_refused_and_leave_the_model_alone(kwargs, exc, name):
    unet = tiny_unet()
    model = LatentModel(unet)
    x, t, c = inputs()
    tome_core.apply_patch(model, ratio=0.3, use_rand=False)
    patched = run(unet, x, t, c)
    hooks = hook_counts(unet)
    with pytest.raises(exc) as info:
        tome_core.apply_patch(model, **kwargs)
    message = str(info.value)
    assert name in message and repr(next(iter(kwargs.values())))[:4] in message
    assert tome_core.get_patch(model).options.ratio == 0.3
    assert hook_counts(unet) == hooks and torch.equal(run(unet, x, t, c), patched)


def test_unknown_option_and_bad_models():
    unet = tiny_unet()
    with pytest.raises(TypeError, match="unknown option.*'ratios'.*the options are: ratio, max_downsample"):
        tome_core.apply_patch(unet, ratios=0.5)
    assert not tome_core.is_patched(unet)
    with pytest.raises(TypeError, match="None"):
        tome_core.apply_patch(None)
    with pytest.raises(TypeError, match="str"):
        tome_core.apply_patch("model")
    mmdit = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no transformer blocks to merge"):
        tome_core.apply_patch(mmdit)
    assert hook_counts(mmdit) == {} and not tome_core.is_patched(mmdit)


class PositionalContextBlock(torch.nn.Module):
    """A block that hands self-attention its context positionally, as None (ldm's signature allows it)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.attn1, self.attn2, self.ff = inner.attn1, inner.attn2, inner.ff
        self.norm1, self.norm2, self.norm3 = inner.norm1, inner.norm2, inner.norm3

    def forward(self, x, context=None):
        x = self.attn1(self.norm1(x), None) + x
        x = self.attn2(self.norm2(x), context) + x
        return self.ff(self.norm3(x)) + x


@pytest.mark.parametrize("options", [dict(method="todo"), dict(ratio=0.5), dict(ratio=0.5, use_rand=False)])
def test_a_positional_none_context_gives_what_the_keyword_call_gives(options):
    """The patch must pass keys and values where the caller passed them, not add a second ``context``."""
    unet = tiny_unet("sd1")
    transformer = unet.input_blocks[1][1]
    x = torch.randn(2, 32, 16, 16)
    c = torch.randn(2, 7, 24)
    tome_core.apply_patch(transformer, **options)
    with torch.no_grad():
        by_keyword = transformer(x, context=c)
        transformer.transformer_blocks[0] = PositionalContextBlock(transformer.transformer_blocks[0])
        tome_core.apply_patch(transformer, **options)
        positional = transformer(x, context=c)
    torch.testing.assert_close(positional, by_keyword)
