# Follows transformers models/mbart/modeling_mbart.py MBartForCausalLM (Donut's text decoder, add_cross_attention):
# encoder_attention_mask (1 = real visual token, 0 = padded patch of a smaller page) masks cross-attention keys,
# the decoder attention_mask masks right-padded prompts; past_key_values decoding must equal the full forward.
import torch
from transformers import MBartConfig, MBartForCausalLM

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

# encoder_layers only sizes the EncoderDecoderCache (num_hidden_layers); keep it equal to decoder_layers
cfg = MBartConfig(vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                  encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, max_position_embeddings=64,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, is_decoder=True,
                  add_cross_attention=True, is_encoder_decoder=False, scale_embedding=True,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2)
model = MBartForCausalLM(cfg).eval().to(torch.float64)

enc_lens, dec_lens = [7, 3], [5, 9]  # second page has only 3 visual tokens but a longer text
Se, Sd = max(enc_lens), max(dec_lens)
enc = torch.randn(2, Se, 32)
enc_mask = (torch.arange(Se)[None] < torch.tensor(enc_lens)[:, None]).long()
ids = torch.full((2, Sd), cfg.pad_token_id)
for b, n in enumerate(dec_lens):
    ids[b, :n] = torch.randint(3, 64, (n,))
dec_mask = (torch.arange(Sd)[None] < torch.tensor(dec_lens)[:, None]).long()

with torch.no_grad():
    batched = model(input_ids=ids, attention_mask=dec_mask, encoder_hidden_states=enc,
                    encoder_attention_mask=enc_mask, use_cache=False).logits
    d_pad = 0.0
    for b in range(2):
        alone = model(input_ids=ids[b:b + 1, :dec_lens[b]], encoder_hidden_states=enc[b:b + 1, :enc_lens[b]],
                      use_cache=False).logits
        d_pad = max(d_pad, (batched[b, :dec_lens[b]] - alone[0]).abs().max().item())

    # cached decoding of page 2 (padded encoder side kept, encoder_attention_mask passed every step)
    seq = ids[1:2, :dec_lens[1]]
    full = model(input_ids=seq, encoder_hidden_states=enc[1:2], encoder_attention_mask=enc_mask[1:2], use_cache=False).logits
    out = model(input_ids=seq[:, :3], encoder_hidden_states=enc[1:2], encoder_attention_mask=enc_mask[1:2], use_cache=True)
    pieces, past = [out.logits], out.past_key_values
    for t in range(3, dec_lens[1]):
        out = model(input_ids=seq[:, t:t + 1], attention_mask=torch.ones(1, t + 1, dtype=torch.long),
                    encoder_hidden_states=enc[1:2], encoder_attention_mask=enc_mask[1:2],
                    past_key_values=past, use_cache=True)
        pieces.append(out.logits)
        past = out.past_key_values
    d_cache = (torch.cat(pieces, 1) - full).abs().max().item()
print(f"max abs diff padded-vs-alone: {d_pad:.3e}; cached-vs-full: {d_cache:.3e}")
assert max(d_pad, d_cache) < 1e-10
