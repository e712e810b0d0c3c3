# Citation: huggingface/transformers src/transformers/models/musicgen/modeling_musicgen.py
#   (MusicgenForCausalLM.build_delay_pattern_mask / apply_delay_pattern_mask, MusicgenForConditionalGeneration.generate
#   with guidance_scale: the batch is doubled with an unconditional half whose encoder_hidden_states are zeroed).
# Masking: decoder self-attention is causal over the delayed codebook stream (KV cache decode); cross-attention uses the
#   right-padded T5 text attention_mask, duplicated for the CFG half, so padded text tokens never serve as keys; the
#   delay pattern (-1 placeholders / pad token) is applied to the generated codes, not to the attention.
import torch
from transformers import (MusicgenConfig, MusicgenDecoderConfig, MusicgenForConditionalGeneration, T5Config,
                          EncodecConfig)

torch.manual_seed(0)
text = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
audio = EncodecConfig(audio_channels=1, sampling_rate=8000, hidden_size=16, num_filters=4, num_residual_layers=1,
                      upsampling_ratios=[4, 4], codebook_size=32, codebook_dim=16, target_bandwidths=[20.0],
                      num_lstm_layers=1)
dec = MusicgenDecoderConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                            num_codebooks=4, max_position_embeddings=64, pad_token_id=32, bos_token_id=32,
                            decoder_start_token_id=32)
config = MusicgenConfig(text_encoder=text.to_dict(), audio_encoder=audio.to_dict(), decoder=dec.to_dict())
model = MusicgenForConditionalGeneration(config).eval()
model.generation_config.pad_token_id = 32
model.generation_config.decoder_start_token_id = 32
model.generation_config.bos_token_id = 32

input_ids = torch.tensor([[5, 9, 12, 7, 1, 0], [3, 8, 1, 0, 0, 0]])
attention_mask = (torch.arange(6)[None] < torch.tensor([[5], [3]])).long()
with torch.no_grad():
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, guidance_scale=3.0,
                         max_new_tokens=8, return_dict_in_generate=True)
codes = out.sequences
print("audio", tuple(codes.shape), f"{codes.float().norm().item():.4f}")
