"""Write a tiny random-weight Llama and a locally trained tokenizer into a directory.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on generated text, the weights
are drawn from a seeded generator. Two layers, hidden size 128: a real forward through vLLM's
Llama code on CPU in milliseconds. Deterministic for a given seed, so a cached copy is reusable.

Usage: python make_model.py OUT_DIR
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 13
VOCAB = 512
TEXT = (
    "the page cache holds keys and values for every token a request wrote; decode reads "
    "what prefill sealed, block by block, over the wire from one node to another while the "
    "scheduler admits new work and frees old blocks when a request finishes or is aborted"
)
WORDS = TEXT.split()


def corpus(n: int) -> list[str]:
    rng = random.Random(SEED)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def write_tokenizer(out: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(2000), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def write_model(out: Path) -> None:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        # Wide weights spread the logits: greedy decoding has no near-ties, so the PD and the
        # single-server text compare exactly.
        initializer_range=0.5,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    # No end-of-sequence during a test: every request decodes its max_tokens.
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    write_model(out)
    print(f"tiny llama: {out}")


if __name__ == "__main__":
    main()
