"""Write a tiny Llama as a local Hugging Face checkpoint, with nothing downloaded:

    python -m autoplan.examples.tiny_hf tiny-llama-hf          # config.json + model.safetensors
    torchrun --nproc-per-node 4 -m autoplan.train --hf-model tiny-llama-hf --steps 40 --save-hf tiny-llama-tuned

The model is `transformers.LlamaConfig` at a small size (default 4 layers, hidden 256, 8 heads of
which 4 key/value heads (GQA), SwiGLU FFN 688, vocabulary 512, 256 positions: 3.2 M parameters),
initialised by transformers' own init under `torch.manual_seed(--seed)` and written with
`save_pretrained` in float32. Embeddings are untied (`tie_word_embeddings=False`): the tensor-parallel
runtime for your own module does not split tied weights yet.

OUT must be new, empty, or an earlier output of this script (it carries the marker file
`.autoplan-example`); any other directory is left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER = ".autoplan-example"


def tiny_llama_config(layers: int = 4, hidden: int = 256, heads: int = 8, kv_heads: int = 4,
                      ffn: int = 688, vocab: int = 512, positions: int = 256):
    """The LlamaConfig of the module docstring (dropout 0, untied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                       max_position_embeddings=positions, tie_word_embeddings=False,
                       attention_dropout=0.0)


def target_error(out: Path) -> str | None:
    """Why `out` may not be written (module docstring), or None."""
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory; choose a new directory"
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        return (f"{out} is a non-empty directory this script did not write (no {MARKER}); "
                f"choose a new or empty directory")
    return None


def write_tiny_llama(out: str | Path, seed: int = 0, **sizes) -> Path:
    """Build the tiny Llama (`tiny_llama_config(**sizes)`) seeded and save it into `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    from autoplan.errors import ConfigError

    out = Path(out)
    error = target_error(out)
    if error:
        raise ConfigError(error)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(**sizes), dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by python -m autoplan.examples.tiny_hf\n")
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    from autoplan.errors import AutoplanError

    p = argparse.ArgumentParser(prog="python -m autoplan.examples.tiny_hf", description=__doc__.split("\n")[0])
    p.add_argument("out", help="the checkpoint directory to write")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the init (default 0)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args(argv)
    try:
        out = write_tiny_llama(args.out, args.seed, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    except AutoplanError as exc:
        print(f"tiny_hf: error: {exc}", file=sys.stderr)
        return 2
    count = sum(1 for _ in out.glob("*.safetensors"))
    print(f"wrote a tiny Llama to {out} (config.json, {count} safetensors file{'s' * (count != 1)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
