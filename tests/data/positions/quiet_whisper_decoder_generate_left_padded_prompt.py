"""Correct as written: transformers' WhisperForCausalLM (tiny, built from its config class) generates from two
left-padded prompts with their attention_mask. The decoder takes position_ids and looks them up in its own table
(`embed_positions`); transformers' generation loop, not the program, calls it, and numbers the prompt by column: the
library's numbering, which the program states nothing against. Nothing is wrong."""

import torch
from transformers import WhisperConfig, WhisperForCausalLM

torch.manual_seed(0)
config = WhisperConfig(vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                       encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, max_target_positions=32,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
model = WhisperForCausalLM(config).eval()
ids = torch.tensor([[5, 9, 13, 7, 21], [0, 0, 17, 8, 26]])
mask = (ids != 0).long()
with torch.no_grad():
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
print(out.tolist())
