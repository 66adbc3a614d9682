"""What ``specrl generate`` and ``specrl bench generate`` share: options and their bounds.

Contract: the ``Annotated`` option types of both commands (model, dtype, k, drafter, verification
rule), the largest batch and token counts they take, and ``parse_dtype(name, device)``: a
``--dtype`` as a torch dtype (torch imported when called), or one ``error:`` line.
"""

from __future__ import annotations

from typing import Annotated

import typer

from specrl.cli_util import fail

ModelOpt = Annotated[
    str,
    typer.Option("--model", help="bundled name (smollm2-135m-instruct), model dir or .gguf file"),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="float32, bfloat16 or auto (bfloat16 where the CPU multiplies it natively, "
        "AVX512-BF16/AMX; else float32, ~8x faster than emulated bf16)",
    ),
]
KOpt = Annotated[int, typer.Option("--num-spec-tokens", help="draft tokens per step (k)")]
ExactOpt = Annotated[
    str,
    typer.Option(
        "--spec-exact",
        help="verification rule: 'distribution' (rejection sampling, the policy's distribution) "
        "or 'sample' (plain sampling's tokens, one for one with the same --seed)",
    ),
]
DrafterOpt = Annotated[
    str | None,
    typer.Option(
        "--drafter",
        help="draft model: a model dir/.gguf, or prefix:N (target's first N layers); for eagle3/"
        "mtp a head dir (default: the one `specrl train-drafter` cached), or 'untrained'",
    ),
]


MAX_BATCH = 4096  # --max-batch, --batch-sizes, --group-size: as the config's rollout.max_batch
MAX_NEW_TOKENS = 1_000_000  # --max-new-tokens, --new-tokens (the context stops them sooner)


def parse_dtype(name: str, device=None):
    """``--dtype`` as a torch dtype; 'auto' for ``device`` (default: the CPU)."""
    import torch

    from specrl.models.precision import torch_dtype

    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "auto": torch_dtype("auto", device)}  # fmt: skip
    if name not in dtypes:
        fail(f"unknown dtype {name!r} (choose float32, bfloat16 or auto)")
    return dtypes[name]
