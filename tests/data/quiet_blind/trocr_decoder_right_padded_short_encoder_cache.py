# Follows transformers models/trocr/modeling_trocr.py TrOCRForCausalLM/TrOCRDecoder: decoder attention_mask (1 = token,
# 0 = right pad) combined with the causal mask; cross-attention from 10 text queries to only 4 image-feature keys, no
# encoder mask. Checked: padded batch vs each line alone, and past_key_values decoding vs one full forward.
import torch
from transformers import TrOCRConfig, TrOCRForCausalLM

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

cfg = TrOCRConfig(vocab_size=60, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                  max_position_embeddings=64, cross_attention_hidden_size=32, use_learned_position_embeddings=True,
                  layernorm_embedding=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
model = TrOCRForCausalLM(cfg).eval().to(torch.float64)

enc = torch.randn(2, 4, 32)  # 4 "patch" features per image: fewer keys than decoder queries
lens = [10, 6]
L = max(lens)
ids = torch.full((2, L), cfg.pad_token_id)
am = torch.zeros(2, L, dtype=torch.long)
for b, n in enumerate(lens):
    ids[b, :n] = torch.randint(3, 60, (n,))
    am[b, :n] = 1

with torch.no_grad():
    batched = model(input_ids=ids, attention_mask=am, encoder_hidden_states=enc, use_cache=False).logits
    d_pad = 0.0
    for b, n in enumerate(lens):
        alone = model(input_ids=ids[b:b + 1, :n], encoder_hidden_states=enc[b:b + 1], use_cache=False).logits
        d_pad = max(d_pad, (batched[b, :n] - alone[0]).abs().max().item())

    # incremental decoding with the cache for the first line: 4-token prefill then one token at a time
    seq = ids[:1, :lens[0]]
    full = model(input_ids=seq, encoder_hidden_states=enc[:1], use_cache=False).logits
    out = model(input_ids=seq[:, :4], encoder_hidden_states=enc[:1], use_cache=True)
    pieces, past = [out.logits], out.past_key_values
    for t in range(4, lens[0]):
        out = model(input_ids=seq[:, t:t + 1], attention_mask=torch.ones(1, t + 1, dtype=torch.long),
                    encoder_hidden_states=enc[:1], past_key_values=past, use_cache=True)
        pieces.append(out.logits)
        past = out.past_key_values
    d_cache = (torch.cat(pieces, 1) - full).abs().max().item()
print(f"max abs diff padded-vs-alone: {d_pad:.3e}; cached-vs-full: {d_cache:.3e}")
assert max(d_pad, d_cache) < 1e-10
