"""A tiny random-weight model folder that vLLM's CPU build loads in seconds: a 2-layer
Qwen2 written by transformers, with a byte-level BPE tokenizer trained on the workload
generator's own words, so prompts build as on the real model. Its tokens are not language;
what tests check with it is scheduling, timing and bookkeeping, never text quality."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edgeprefill.runtime.traffic.prompts import generate_text


def write_tiny_model(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = generate_text(np.random.default_rng(0), 20_000)
    bpe.train_from_iterator(text.split("\n\n"), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
        initializer_range=0.5,  # varied greedy tokens rather than one repeated
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def tiny_settings(folder: Path, **kw: Any) -> Any:
    """vLLM settings the tests run the tiny model with: small, exact and quick to start
    on a CPU (float32, no graph capture, a quarter GiB of KV cache); `kw` overrides."""
    from edgeprefill.backends.vllm.backend import VllmSettings

    defaults = {
        "n_ctx": 2048,
        "n_batch": 1024,
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_gib": 0.25,
    }
    return VllmSettings(folder, **{**defaults, **kw})
