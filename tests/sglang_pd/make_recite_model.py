"""Write a tiny Llama whose weights recite what its KV holds: the marker test's model.

The bed's other model (tests/vllm_pd/make_model.py) has random weights: what it says tells
nothing about what it read. The marker test needs a model that turns the KV it attends over
into text, as a real model does when asked to repeat codes. This one does it by construction
(no training), in SGLang's own Llama code:

- Layer 1: three heads, each attending by position only (a constant query and key in the fast
  rotary pairs, peaked at 1, 2 and 3 tokens back), copy the previous three tokens' embeddings
  into their own parts of the residual.
- Layer 2: one induction head, in the slow rotary pairs (position-free at these lengths): the
  query is (this token, the one before, the one before that), the key of each cached slot the
  three tokens before it, the value its own token. So the next token is what followed the same
  three tokens wherever they occur in the KV: written by this request or left by another.
- No MLP (zero down projections); the output head reads the copied token only.
- Token 0, the one-token stub SGLang puts in place of a rejected prompt, is nothing as a key or
  a value; as a query it asks for what follows "-": a request holding only the stub starts
  reciting at a code ("CANARY-...") in whatever KV its pages hold.

The tokenizer is make_model.py's, trained with the marker test's words added (so a single hex
digit is a token only inside a code).

Usage: python make_recite_model.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_pd"))
import make_model

VOCAB = make_model.VOCAB
#: What the marker test sends, besides the codes, in the tokenizer's training text: its words
#: become whole tokens, so a single hex digit is a token only inside a code.
PROBE_TEXT = "word word word Remember the code CANARY-. Repeat any codes you saw."

SEED = 29
PART = 80  # dimensions of one token's part of the residual
HEAD = 512  # head dimension: 256 rotary pairs
THETA = 1e12  # pair i turns THETA ** (-i / 256) per position: 0-63 fast, 128-255 frozen
FAST = 64
SLOW = 128
BACK = (1, 2, 3)
SHARP = 16.0  # per fast pair: one position off costs about 2.5 * SHARP nats
MATCH = 64.0  # per matching token in the induction head
CUE = 2.0  # the stub's ask for a code, in matching tokens
CONTEXT = 16384


def parts() -> dict[str, slice]:
    """The residual's parts: E (this token, as read), V (this token, as recited), P1-P3 (one to
    three back), C (the copy)."""
    names = ("E", "V", "P1", "P2", "P3", "C")
    return {n: slice(i * PART, (i + 1) * PART) for i, n in enumerate(names)}


def build(out: Path, dash: int) -> None:
    layout = parts()
    hidden = 6 * PART + 21  # a multiple of the head count (transformers checks it)
    const = 6 * PART
    gen = torch.Generator().manual_seed(SEED)
    codes = torch.randn(VOCAB, PART, generator=gen)
    codes /= codes.norm(dim=1, keepdim=True)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=HEAD,
        rope_theta=THETA,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    for key in state:
        if key.endswith("layernorm.weight") or key == "model.norm.weight":
            state[key] += 1.0
    # The embedding: this token's code and a constant, every row of one norm.
    constant = 1.0
    embed = state["model.embed_tokens.weight"]
    embed[:, layout["E"]] = codes
    embed[:, layout["V"]] = codes
    embed[:, const] = constant
    # The one-token stub of a rejected prompt is token 0. It is nothing as a key or a value,
    # and as a query it asks for what follows "-" (as in "CANARY-", see the induction head), so
    # a request that holds only the stub starts reciting at a code in the KV around it, as a
    # model asked to "repeat any codes you saw" would. No other text holds token 0.
    embed[0, layout["E"]] = 0.0
    embed[0, layout["V"]] = 0.0
    embed[0, const + 1] = 2.0**0.5
    # RMSNorm scales a residual of norm r by sqrt(hidden) / r: undone in the projections.
    s1 = math.sqrt(hidden / (2 + constant**2))
    s2 = math.sqrt(hidden / (5 + constant**2))
    omega = THETA ** (-torch.arange(FAST, dtype=torch.float64) / (HEAD // 2))
    a = "model.layers.0.self_attn."
    for h, back in enumerate(BACK):
        q, k = torch.zeros(HEAD, hidden), torch.zeros(HEAD, hidden)
        # Pair i holds (x_i, x_{i+256}); the score is sum_i cos(omega_i * (m - n - back)).
        scale = SHARP * math.sqrt(HEAD) / s1 / s1
        q[:FAST, const] = (torch.cos(-omega * back) * scale).float()
        q[HEAD // 2 : HEAD // 2 + FAST, const] = (torch.sin(-omega * back) * scale).float()
        k[:FAST, const] = 1.0
        rows = slice(h * HEAD, (h + 1) * HEAD)
        state[a + "q_proj.weight"][rows] = q
        state[a + "k_proj.weight"][rows] = k
        state[a + "v_proj.weight"][h * HEAD : h * HEAD + PART, layout["E"]] = torch.eye(PART) / s1
        o = state[a + "o_proj.weight"]
        o[layout[f"P{back}"], h * HEAD : h * HEAD + PART] = torch.eye(PART)
    # Layer 2, head 0: slow pairs (frozen at these lengths); three blocks of PART dimensions.
    a = "model.layers.1.self_attn."
    scale = MATCH * math.sqrt(HEAD) / s2 / s2
    for j, (mine, theirs) in enumerate((("E", "P1"), ("P1", "P2"), ("P2", "P3"))):
        dims = slow_dims(j)
        state[a + "q_proj.weight"][dims, layout[mine]] = torch.eye(PART) * scale
        state[a + "k_proj.weight"][dims, layout[theirs]] = torch.eye(PART)
    state[a + "q_proj.weight"][slow_dims(0), const + 1] = CUE * codes[dash] * scale / 2**0.5
    state[a + "v_proj.weight"][:PART, layout["V"]] = torch.eye(PART) / s2
    state[a + "o_proj.weight"][layout["C"], :PART] = torch.eye(PART)
    state["lm_head.weight"][:, layout["C"]] = codes * 50.0
    model.load_state_dict(state)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))


def slow_dims(block: int) -> list[int]:
    """The head dimensions of block 0-2 of the induction head: slow pairs only, each pair's
    two halves (i and i + 256) both used."""
    pairs = list(range(HEAD // 2 - SLOW, HEAD // 2))  # 128 slow pairs: 256 dimensions
    dims = [d for i in pairs for d in (i, i + HEAD // 2)]
    return dims[block * PART : (block + 1) * PART]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    corpus = make_model.corpus
    make_model.corpus = lambda n: corpus(n) + [PROBE_TEXT] * (n // 4)  # type: ignore[assignment]
    make_model.write_tokenizer(out)
    dash = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("-")
    build(out, dash)
    print(f"recite llama: {out}")


if __name__ == "__main__":
    main()
