"""transformers MarianMT (random weights): a right-padded batch of source sentences translated greedily.

Follows huggingface/transformers src/transformers/models/marian/modeling_marian.py (MarianEncoder /
MarianDecoder with sinusoidal positions) and the translation usage of MarianTokenizer, which pads on the right
and returns `attention_mask`; `model.generate(input_ids, attention_mask=...)` runs the encoder once and decodes
with a cache.

Masks meant:
- encoder self-attention: bidirectional over the real source tokens of each row, pad keys hidden (pad query rows
  compute garbage that nobody reads: the decoder never attends to them);
- decoder self-attention: causal over the target, starting at decoder_start_token_id (= pad id in Marian, which
  is a real first token there, not padding);
- cross-attention: every target token sees all real source tokens of its row, none of the pads, no causal
  structure; targets (up to 10 tokens) are longer than the shortest source (3 tokens).
"""
import torch
from transformers import AutoModelForSeq2SeqLM, MarianConfig


def main():
    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=80, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=79, eos_token_id=0, decoder_start_token_id=79, forced_eos_token_id=0,
    )
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="sdpa").eval()

    sources = [[11, 12, 13, 14, 15, 16, 0], [21, 22, 0], [31, 32, 33, 34, 0]]
    width = max(len(s) for s in sources)
    input_ids = torch.tensor([s + [config.pad_token_id] * (width - len(s)) for s in sources])
    attention_mask = (input_ids != config.pad_token_id).long()

    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10,
                             min_new_tokens=10, num_beams=1, do_sample=False)
    print(out.tolist())


if __name__ == "__main__":
    main()
