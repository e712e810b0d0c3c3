# Static-shape translation as export pipelines run it (optimum / ONNX style: every source padded to max_length with
# the tokenizer's padding="max_length", one request at a time, attention_mask 1 = real): a Marian model generates
# for each source padded on the right to 8 tokens, then for the same source alone, unpadded. The second source fills
# all 8 slots, so its encoder has no padding at all, after the first source's encoder padded 5 of the same 8 keys.
# Marian's sinusoidal positions count from the left, so right padding moves no token: padded must equal alone.
import torch
from transformers import MarianConfig, MarianMTModel

torch.manual_seed(2)
cfg = MarianConfig(vocab_size=53, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                   dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=52,
                   decoder_start_token_id=52, eos_token_id=0, forced_eos_token_id=None)
model = MarianMTModel(cfg).double().eval()
model.set_attn_implementation("sdpa")
model.generation_config.eos_token_id = None
model.generation_config.forced_eos_token_id = None
model.generation_config.bad_words_ids = None

max_length = 8
worst = 0.0
with torch.no_grad():
    for n in (3, 8, 5):
        src = torch.randint(1, 52, (n,))
        ids = torch.full((1, max_length), cfg.pad_token_id, dtype=torch.long)
        ids[0, :n] = src
        mask = (torch.arange(max_length) < n).long()[None]
        padded = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        alone = model.generate(src[None], attention_mask=torch.ones(1, n, dtype=torch.long), max_new_tokens=6,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert torch.equal(padded.sequences, alone.sequences)
        d = (torch.stack(padded.logits) - torch.stack(alone.logits)).abs().max().item()
        assert d == d, "NaN"
        worst = max(worst, d)
print(f"max |max_length-padded - alone| = {worst:.3e}")
assert worst < 1e-6
