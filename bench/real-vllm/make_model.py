"""Builds a randomly initialised Qwen2 model for vLLM, entirely locally (no model hub).

Two shapes (`--size`):
- `tiny` (default): shared/docs/vllm-interfaces.md section 4a: 2 layers, hidden size 128, 2 heads of 64,
  Qwen2's vocabulary (151,936 rows), bf16 weights (~40 MB, 19.8M parameters);
- `small`: 4 layers, hidden 256, MLP 768, 4 query heads and 2 KV heads of 64 (3.2M parameters besides
  the 39M of the tied embedding): about 6 MFLOP per prompt token, so a 2,000-token prefill takes a few
  hundred milliseconds on two AVX2 cores and a prefix-cache hit saves most of it (`calibrate.py`);
- `0.5b`: Qwen2-0.5B's published shape (24 layers, hidden 896, MLP 4,864, 14 query heads and 2 KV heads
  of 64, tied embeddings; 494M parameters, ~1 GB in bf16). About 1 GFLOP per prompt token: on the
  2-core AVX2 machines here (no AVX-512, so bf16 is emulated) a 2,048-token prefill took 194 s, far too
  slow to benchmark; kept for machines with more cores. The tokenizer files are copied unchanged from
the Qwen2 tokenizer the gateway uses (.assets/qwen2), so vLLM and the gateway render the same chat
template and produce the same tokens. The weights are random: the answers are noise, but prefill,
prefix caching, KV events and metrics behave as with any model.

Usage: python make_model.py --tokenizer-dir .assets/qwen2 --out DIR
"""

import argparse
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

# transformers' fast tokenizer needs only the first two; the slow tokenizer's files are copied when present
# (`cargo xtask setup` fetches only tokenizer.json and tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_TOKENIZER_FILES = ("vocab.json", "merges.txt")

SHAPES = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-position-embeddings", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=151936,
        **SHAPES[args.size],
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(bos_token_id=151643, eos_token_id=151645).save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.tokenizer_dir / name, args.out / name)
    for name in OPTIONAL_TOKENIZER_FILES:
        if (args.tokenizer_dir / name).is_file():
            shutil.copyfile(args.tokenizer_dir / name, args.out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.size} Qwen2: {params / 1e6:.1f}M parameters -> {args.out}")


if __name__ == "__main__":
    main()
