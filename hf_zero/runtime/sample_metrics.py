"""One value per sample (a sequence length), in the indexed file pair DeepSpeed's DataAnalyzer writes:
``<prefix>.bin`` (the values) and ``<prefix>.idx`` (Megatron's "MMIDIDX" index: version 1, a dtype code, the
element count and document count, then int32 sizes, int64 byte pointers and int64 document starts).

Dynamic batching (variable_batch.py) reads ``<metrics_path>/seqlen/seqlen_sample_to_metric`` when it exists --
written by DeepSpeed or by an earlier hf_zero run -- and writes it when it does not, so either engine reuses the
other's lengths. Written by hand rather than through DeepSpeed's builder: hf_zero does not depend on DeepSpeed.
"""

from __future__ import annotations

import os
import struct

import numpy as np

__all__ = ["read_sample_metric", "write_sample_metric", "metric_files_exist"]

_MAGIC = b"MMIDIDX\x00\x00"
# DeepSpeed's dtype codes (data_sampling/indexed_dataset.py)
_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16, 7: np.uint32, 8: np.uint64}


def metric_files_exist(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def read_sample_metric(prefix: str) -> np.ndarray:
    """Every sample's value, in sample order (a sample holding several values contributes them all)."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(len(_MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < len(_MAGIC) + 25 or head[:len(_MAGIC)] != _MAGIC:
            raise ValueError(f"hf_zero: {prefix}.idx is not an indexed-dataset index (magic {head[:9]!r})")
        (version,) = struct.unpack("<Q", head[9:17])
        code = head[17]
        count, _docs = struct.unpack("<QQ", head[18:34])
        if version != 1 or code not in _CODES:
            raise ValueError(f"hf_zero: {prefix}.idx: version {version}, dtype code {code} are not supported")
        sizes = np.frombuffer(f.read(4 * count), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * count), dtype=np.int64)
    dtype = np.dtype(_CODES[code])
    data = np.fromfile(prefix + ".bin", dtype=np.uint8)
    if len(sizes) != count or len(pointers) != count:
        raise ValueError(f"hf_zero: {prefix}.idx is truncated ({len(sizes)} of {count} sizes)")
    values = [np.frombuffer(data, dtype=dtype, count=int(n), offset=int(p)) for n, p in zip(sizes, pointers)]
    return np.concatenate(values) if values else np.empty(0, dtype=dtype)


def write_sample_metric(prefix: str, values) -> None:
    """One int64 value per sample, as one document; each file is written beside and renamed into place."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    count = len(values)
    pointers = np.arange(count, dtype=np.int64) * values.itemsize
    index = (_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", 5) + struct.pack("<QQ", count, 2)
             + np.ones(count, dtype=np.int32).tobytes() + pointers.tobytes()
             + np.array([0, count], dtype=np.int64).tobytes())
    for suffix, payload in ((".bin", values.tobytes()), (".idx", index)):
        tmp = f"{prefix}{suffix}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, prefix + suffix)
