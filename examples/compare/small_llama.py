"""A small byte-level Llama saved to a folder, for `attnres compare --from-scratch` on a CPU: the architecture of
the project's quality study (`small`: 6 layers, d=128, 1.2M parameters, vocabulary 259 bytes and specials).

    python examples/compare/small_llama.py small-llama
"""

import sys

from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM


def main(folder: str) -> None:
    tokenizer = ByT5Tokenizer(extra_ids=0)  # bytes: no vocabulary to learn, and a tiny embedding
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"{folder}: {sum(p.numel() for p in LlamaForCausalLM(config).parameters()):,} parameters")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "small-llama")
