"""Calibration traces of ``specrl bench gpu``: what ``specrl simulate calibrate`` reads.

Contract: ``trace_document(records, device, config, model_name, out, meta)`` is a trace
(format: specrl/sim/calibrate.py): the machine and the bundled hardware profile to scale, named
from the device (``hardware_name``), the model (``model_name``, a bundled spec; empty: a spec of
``config`` written beside ``out`` as ``<out>.model.toml``, named by its absolute path: smoke
runs' tiny models), bf16, the records and ``meta``. Both the check's engine section and the
calibration grid write theirs with it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specrl.models.config import ModelConfig

# A GPU name's part -> the bundled hardware profile (the first match; otherwise h100)
HARDWARE_BY_NAME = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"))
TINY_SPEC_NAME = "tiny-llama"


def hardware_name(device: torch.device) -> tuple[str, str]:
    """(machine description, bundled hardware profile to scale) for ``device``."""
    if device.type != "cuda":
        return f"cpu ({torch.get_num_threads()} threads)", "cpu-2core"
    name = torch.cuda.get_device_name(device)
    profile = next((p for key, p in HARDWARE_BY_NAME if key in name), "h100")
    return f"1x {name}", profile


def model_spec_toml(config: ModelConfig, name: str) -> str:
    """A simulator model spec (specrl/sim/data/models layout) for ``config``."""
    params = float(config.num_parameters())
    fields = {
        "name": f'"{name}"',
        "layers": config.num_layers,
        "hidden": config.hidden_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab": config.vocab_size,
        "intermediate": config.intermediate_size,
        "params_total": params,
        "params_active": params,
    }
    return "".join(f"{k} = {v}\n" for k, v in fields.items())


def trace_document(
    records: list[dict],
    device: torch.device,
    config: ModelConfig,
    model_name: str,
    out: Path,
    meta: dict,
) -> dict:
    """The trace (module docstring); writes the model spec beside ``out`` when ``model_name``
    is empty."""
    machine, hardware = hardware_name(device)
    model = model_name
    if not model:
        spec = out.with_suffix(".model.toml")
        spec.write_text(model_spec_toml(config, TINY_SPEC_NAME))
        model = str(spec.resolve())
    return {"machine": machine, "model": model, "dtype": "bf16", "hardware": hardware,
            "records": records, "meta": meta}  # fmt: skip
