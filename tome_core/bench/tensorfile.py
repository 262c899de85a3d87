"""A checkpoint file's tensors, read without the ``safetensors`` package: ``TensorFile`` reads a
``.safetensors`` file or a ``.ckpt``/``.pt`` pickle a part at a time, and ``CheckpointError`` is the one-line
refusal of a file that is missing, unreadable or of another kind.

What the tensors make (a U-Net, text encoders, a VAE, a whole pipeline) is ``checkpoint``'s concern.
"""

from __future__ import annotations

import json
import os
import pickle

import torch


class CheckpointError(ValueError):
    """The file is missing, unreadable, or holds no U-Net this benchmark can build."""


class TensorFile:
    """A checkpoint's tensors, read a part at a time: a ``.safetensors`` file is read tensor by tensor, a
    ``.ckpt``/``.pt`` pickle is memory-mapped where its format allows (else loaded whole). So building one part
    never holds the others in memory, and no part is read twice.

    ``keys``: every tensor name. ``metadata``: a ``.safetensors`` file's text metadata (else empty).
    ``shapes(prefix)``: the tensors under ``prefix`` as meta tensors (shapes only, nothing read).
    ``read(prefix)``: the tensors under ``prefix`` (keys kept whole).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._safetensors = None
        self._tensors: dict[str, torch.Tensor] | None = None
        if not os.path.isfile(path):
            raise CheckpointError(f"--checkpoint {path}: no such file")
        try:
            if path.endswith(".safetensors"):
                self._safetensors = _SafetensorsReader(path)
                self.keys = list(self._safetensors.entries)
                self.metadata = self._safetensors.metadata
                return
            data = _load_pickle(path)
        except Exception as error:  # safetensors, pickle and zip each raise their own kinds
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"--checkpoint {path}: not a readable .safetensors or .ckpt file ({first_line})") \
                from None
        if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
            data = data["state_dict"]
        if not isinstance(data, dict):
            raise CheckpointError(f"--checkpoint {path}: holds a {type(data).__name__}, not a dictionary of tensors")
        self._tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        self.keys = list(self._tensors)
        self.metadata: dict[str, str] = {}

    def shapes(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tensors under ``prefix`` as meta tensors: their shapes, nothing read."""
        if self._tensors is not None:
            return {k: torch.empty(v.shape, device="meta") for k, v in self._tensors.items() if k.startswith(prefix)}
        return {k: torch.empty(self._safetensors.entries[k][1], device="meta")
                for k in self.keys if k.startswith(prefix)}

    def read(self, prefix: str = "", dtype: torch.dtype | None = None,
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The tensors under ``prefix``; floating-point ones converted to ``dtype`` and moved to ``device`` as
        each is read, so the file's copy of one tensor at most is held besides the converted ones."""
        def convert(tensor: torch.Tensor) -> torch.Tensor:
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            return tensor if device is None else tensor.to(device)

        if self._tensors is not None:
            return {k: convert(v) for k, v in self._tensors.items() if k.startswith(prefix)}
        return {k: convert(self._safetensors.tensor(k)) for k in self.keys if k.startswith(prefix)}

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor ``key``, or None when the file has none of that name."""
        return self.read(key).get(key) if key in self.keys else None


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class _SafetensorsReader:
    """A ``.safetensors`` file read one tensor at a time with plain file reads (format: an 8-byte little-endian
    header length, a JSON header of name -> dtype, shape, byte offsets, then the data).

    ``safetensors``' own reader maps the whole file into memory: every byte read stays counted in the
    process's resident memory (as page cache) until the file is closed, which shows a 2 GB SD 1.5 file as
    2 GB more peak memory than the model needs. Reading into fresh buffers counts only what is kept.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= size - 8:
                raise ValueError(f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(f.read(length))
        self.data_start = 8 + length
        self.metadata: dict[str, str] = header.get("__metadata__") or {}
        self.entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, which this reader does not know")
            begin, end = info["data_offsets"]
            self.entries[name] = (_SAFETENSORS_DTYPES[info["dtype"]], list(info["shape"]), begin, end)

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        buffer = bytearray(end - begin)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(buffer) != len(buffer):
                raise CheckpointError(f"--checkpoint {self.path}: truncated (tensor {name!r} is cut off)")
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _load_pickle(path: str):
    """A ``.ckpt``/``.pt`` file's contents, tensors memory-mapped when it is in PyTorch's zip format (since 1.6);
    older files have no layout to map and are read whole.

    Loaded with ``weights_only``, so no code in the file runs. Checkpoints saved by PyTorch Lightning also pickle
    training state (a ``ModelCheckpoint`` callback, numpy scalars) that ``weights_only`` refuses; those objects
    are rebuilt as inert stand-ins (nothing of them is used), as the webui's restricted unpickler lets them by.
    """
    try:
        return _torch_load(path)
    except pickle.UnpicklingError:
        if not hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):  # torch < 2.5
            raise
    stand_ins = [_stand_in(name) for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)]
    with torch.serialization.safe_globals(stand_ins):
        return _torch_load(path)


def _torch_load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
    return torch.load(path, map_location="cpu", weights_only=True)


def _stand_in(qualified_name: str) -> type:
    """An inert class answering to ``qualified_name``: any arguments, any state, no behaviour."""
    module, _, name = qualified_name.rpartition(".")

    def ignore(self, *args, **kwargs) -> None:
        pass

    cls = type(name, (), {"__init__": ignore, "__setstate__": ignore})
    cls.__module__, cls.__qualname__ = module, name
    return cls


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file or a ``.ckpt``/``.pt`` pickle (loaded with ``weights_only``)."""
    return TensorFile(path).read()
