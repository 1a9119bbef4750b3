"""What a publisher must send: the HF-style parameter names, dtypes and shapes of the model.

Read from the safetensors headers of the served checkpoint (no tensor data is loaded),
so the names are exactly what ``named_parameters()`` of the matching transformers
model yields.
"""

from __future__ import annotations

from pathlib import Path

from rollout.contracts.sync_protocol import ParamSpec

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64", "I32": "int32", "U8": "uint8"}


def checkpoint_spec(model_path: str | Path) -> list[ParamSpec]:
    import json
    import struct

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors files")
    specs = []
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            specs.append(ParamSpec(name, _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"].lower()), tuple(meta["shape"])))
    return specs
