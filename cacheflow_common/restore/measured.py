"""What a profile is measured for, read off a model: its weights' fingerprint, compute dtype and device.
A profile records it when measured (`cacheflow_common.engine.profiler`) and is refused for any other model
(`Profile.check_fits`)."""

from __future__ import annotations

import torch

from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.profile import MeasuredFor
from cacheflow_common.restore.save import dtype_name


def measured_as(model: Transformer) -> MeasuredFor:
    """What a profile of `model` is measured for: its fingerprint, dtype and device."""
    return MeasuredFor(model=model.fingerprint(), dtype=dtype_name(model.dtype), device=device_label(model.device))


def device_label(device: torch.device) -> str:
    """"cpu", or "cuda (<the GPU's name>)": costs measured on one GPU model do not hold on another."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type
