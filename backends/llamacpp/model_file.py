"""Find and check the GGUF file before llama.cpp sees it: llama.cpp prints pages of logs
and returns NULL on a bad file; a user deserves one line that says what to fix."""

from __future__ import annotations

from pathlib import Path

from edgeprefill.runtime.core.errors import UserError

GGUF_MAGIC = b"GGUF"


def check_model_file(path: Path) -> Path:
    if not path.exists():
        raise UserError(
            f"model file {path} does not exist; give `model` as the path to a .gguf file"
        )
    if not path.is_file():
        raise UserError(
            f"model path {path} is not a file; give `model` as the path to a .gguf file"
        )
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise UserError(
            f"model file {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "convert it with llama.cpp's convert_hf_to_gguf.py or give another `model`"
        )
    return path
