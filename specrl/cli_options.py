"""What ``specrl generate`` and ``specrl bench generate`` share: options and their bounds.

Contract: the ``Annotated`` option types of both commands (model, dtype, k, drafter, verification
rule) and their help texts (``HELP``: ``generate`` declares the same options as shortcuts of its
settings, ``cli_util.Shortcuts``), the largest batch and token counts they take (the bounds of
``config_commands``), and ``parse_dtype(name, device)``: a ``--dtype`` as a torch dtype (torch
imported when called), or one ``error:`` line.
"""

from __future__ import annotations

from typing import Annotated

import typer

from specrl.cli_util import fail
from specrl.config_commands import MAX_BATCH, MAX_NEW_TOKENS

HELP = {
    "model": "bundled name (smollm2-135m-instruct), model dir or .gguf file",
    "dtype": "float32, bfloat16 or auto (bfloat16 where the CPU multiplies it natively, "
    "AVX512-BF16/AMX; else float32, ~8x faster than emulated bf16)",
    "num_spec_tokens": "draft tokens per step (k)",
    "spec_exact": "verification rule: 'distribution' (rejection sampling, the policy's "
    "distribution) or 'sample' (plain sampling's tokens, one for one with the same --seed)",
    "drafter": "draft model: a model dir/.gguf, or prefix:N (target's first N layers); for eagle3/"
    "mtp a head dir (default: the one `specrl train-drafter` cached), or 'untrained'",
}

ModelOpt = Annotated[str, typer.Option("--model", help=HELP["model"])]
DtypeOpt = Annotated[str, typer.Option("--dtype", help=HELP["dtype"])]
KOpt = Annotated[int, typer.Option("--num-spec-tokens", help=HELP["num_spec_tokens"])]
ExactOpt = Annotated[str, typer.Option("--spec-exact", help=HELP["spec_exact"])]
DrafterOpt = Annotated[str | None, typer.Option("--drafter", help=HELP["drafter"])]


def parse_dtype(name: str, device=None):
    """``--dtype`` as a torch dtype; 'auto' for ``device`` (default: the CPU)."""
    import torch

    from specrl.models.precision import torch_dtype

    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "auto": torch_dtype("auto", device)}  # fmt: skip
    if name not in dtypes:
        fail(f"unknown dtype {name!r} (choose float32, bfloat16 or auto)")
    return dtypes[name]


__all__ = ["HELP", "MAX_BATCH", "MAX_NEW_TOKENS", "DrafterOpt", "DtypeOpt", "ExactOpt", "KOpt",
           "ModelOpt", "parse_dtype"]  # fmt: skip
