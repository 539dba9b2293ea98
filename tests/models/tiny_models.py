"""Tiny random-weight models built locally (no hub): Llama-like, DeepSeek-V2-like MLA, Gemma-3-like
sliding-window and hybrid (Mamba / gated delta net) models.

``ensure_model(kind)`` returns a directory vLLM can load (config, safetensors weights, a
byte-level BPE tokenizer trained here). Models are cached under ``~/.cache/xkv/models`` (or
``$XKV_MODEL_CACHE``) keyed by a hash of the recipe below, so reruns cost nothing; change the
recipe and a new directory is built. Runs with ``HF_HUB_OFFLINE=1``.

    python tests/models/tiny_models.py llama deepseek_v2     # prints the paths

Shapes: llama — hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, fp32 (vLLM's CPU
attention wants block sizes that are multiples of 32). llama_demo — the demo's: hidden 512, 4
layers, 8 heads, 2 KV heads, head_dim 64, fp32. deepseek_v2 — MLA with kv_lora_rank 512 +
qk_rope_head_dim 64 = head size 576 (the only one vLLM's CPU MLA kernel supports), bf16, both
layers dense (``first_k_dense_replace=2``). gemma3 — 6 layers, pattern sliding, sliding, full x 2,
window 64 tokens, 2 KV heads x 32, fp32.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]

RECIPES: dict[str, dict] = {
    "llama": {
        "arch": "LlamaForCausalLM",
        "config": dict(
            model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
            rms_norm_eps=1e-5, initializer_range=0.2, torch_dtype="float32", tie_word_embeddings=False,
        ),
    },
    # make demo's model (examples/store_and_restore.py): wide enough that a prefill costs far more
    # than copying its KV pages (2 KV heads of 4 layers, ~15 M parameters), still built in seconds
    "llama_demo": {
        "arch": "LlamaForCausalLM",
        "config": dict(
            model_type="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
            rms_norm_eps=1e-5, initializer_range=0.05, torch_dtype="float32", tie_word_embeddings=False,
        ),
    },
    "deepseek_v2": {
        "arch": "DeepseekV2ForCausalLM",
        "config": dict(
            model_type="deepseek_v2", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
            q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2,
            moe_layer_freq=1, max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.2,
            torch_dtype="bfloat16", tie_word_embeddings=False, rope_scaling=None,
        ),
    },
    # Sliding-window model (issue 18): 4 sliding layers (window 64) + 2 full-attention layers;
    # vLLM's hybrid allocator gives it two SlidingWindowSpec groups and one FullAttentionSpec group.
    "gemma3": {
        "arch": "Gemma3ForCausalLM",
        "config": dict(
            model_type="gemma3_text", hidden_size=128, intermediate_size=256, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
            sliding_window=64, layer_types=["sliding_attention", "sliding_attention",
                                            "full_attention"] * 2,
            rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
            query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh",
            initializer_range=0.2, torch_dtype="float32", tie_word_embeddings=True,
        ),
    },
    # Hybrid recipes (issue 5). vLLM's CPU engine raises the block size of hybrid models itself
    # (nemotron_h 96, granitemoehybrid 64, qwen3_next 160 with these shapes).
    "nemotron_h": {  # pattern M*M-: Mamba2, attention, Mamba2, MLP -> 3 KV cache groups
        "arch": "NemotronHForCausalLM",
        "config": dict(
            model_type="nemotron_h", hidden_size=128, intermediate_size=256,
            layers_block_type=["mamba", "attention", "mamba", "mlp"],
            hybrid_override_pattern="M*M-", num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=8,
            mamba_head_dim=32, ssm_state_size=16, n_groups=1, conv_kernel=4, expand=2,
            chunk_size=64, max_position_embeddings=2048, initializer_range=0.2,
            layer_norm_epsilon=1e-5, torch_dtype="bfloat16", tie_word_embeddings=False,
        ),
    },
    "granitemoehybrid": {  # mamba/attention/mamba/attention, dense (no experts) -> 2 groups
        "arch": "GraniteMoeHybridForCausalLM",
        "config": dict(
            model_type="granitemoehybrid", hidden_size=128, intermediate_size=256,
            shared_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"],
            num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=8, mamba_d_head=32,
            mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=64, position_embedding_type="rope", max_position_embeddings=2048,
            initializer_range=0.2, rms_norm_eps=1e-5, torch_dtype="bfloat16",
            tie_word_embeddings=False,
        ),
    },
    "qwen3_next": {  # gated delta net + full attention x2, MoE; CPU GDN needs head dim 128
        "arch": "Qwen3NextForCausalLM",
        "config": dict(
            model_type="qwen3_next", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
            linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1,
            max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-6,
            torch_dtype="bfloat16", tie_word_embeddings=False,
        ),
    },
}


def cache_root() -> Path:
    return Path(os.environ.get("XKV_MODEL_CACHE", Path.home() / ".cache" / "xkv" / "models"))


def recipe_hash(kind: str) -> str:
    import transformers

    body = {"recipe": RECIPES[kind], "vocab": VOCAB, "specials": SPECIALS, "tok": 2,
            "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _corpus(n_lines: int = 3000) -> list[str]:
    rng = random.Random(0)
    syll = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return [" ".join("".join(rng.choice(syll) for _ in range(rng.randint(1, 3)))
                     for _ in range(rng.randint(5, 15))) for _ in range(n_lines)]


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)


def _build(kind: str, out: Path) -> None:
    import torch
    import transformers

    recipe = RECIPES[kind]
    cfg = dict(recipe["config"])
    model_type = cfg.pop("model_type")
    dtype = getattr(torch, cfg.pop("torch_dtype"))
    config = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=1,
                                               eos_token_id=2, pad_token_id=3, **cfg)
    config.architectures = [recipe["arch"]]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    model.config.torch_dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer(out)


def ensure_model(kind: str) -> Path:
    """Path of the tiny ``kind`` model, building it once per recipe."""
    if kind not in RECIPES:
        raise ValueError(f"unknown tiny model {kind!r}; known: {sorted(RECIPES)}")
    dest = cache_root() / f"{kind}-{recipe_hash(kind)}"
    if (dest / "config.json").exists() and (dest / "tokenizer.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=dest.parent))
    try:
        _build(kind, tmp)
        try:
            tmp.rename(dest)
        except OSError:  # built concurrently by another process: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


if __name__ == "__main__":
    for k in sys.argv[1:] or list(RECIPES):
        print(ensure_model(k))
