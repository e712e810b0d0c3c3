# Follows transformers models/blip_2/modeling_blip_2.py Blip2ForConditionalGeneration.forward/generate:
# inputs_embeds = cat([language_model_inputs, text embeds]), attention_mask = cat([ones for the 32->4 query tokens,
# left-padded text mask]) so padding sits in the MIDDLE ([Q Q Q Q pad pad t t]); OPT positions come from the mask.
import torch
from transformers import OPTConfig, OPTModel
torch.manual_seed(0)
cfg = OPTConfig(vocab_size=50, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, word_embed_proj_dim=32, attn_implementation="eager", dropout=0.0)
lm = OPTModel(cfg).double().eval()
Nq = 4
lens = [6, 2, 4]; T = max(lens); B = len(lens)
query_output = torch.randn(B, Nq, 32, dtype=torch.float64)                 # language_projection(qformer output)
seqs = [torch.randint(1, 50, (n,)) for n in lens]
ids = torch.full((B, T), cfg.pad_token_id); am = torch.zeros(B, T, dtype=torch.long)
for b, s in enumerate(seqs): ids[b, T - len(s):] = s; am[b, T - len(s):] = 1   # tokenizer padding_side="left"
emb = lm.get_input_embeddings()
with torch.no_grad():
    language_model_attention_mask = torch.ones(query_output.shape[:-1], dtype=torch.long)
    inputs_embeds = torch.cat([query_output, emb(ids)], dim=1)
    attention_mask = torch.cat([language_model_attention_mask, am], dim=1)
    out = lm(inputs_embeds=inputs_embeds, attention_mask=attention_mask).last_hidden_state
    md = 0.0
    for b, s in enumerate(seqs):
        e = torch.cat([query_output[b:b + 1], emb(s[None])], 1)
        ref = lm(inputs_embeds=e).last_hidden_state[0]                      # alone, no padding, no mask
        md = max(md, (out[b, :Nq] - ref[:Nq]).abs().max().item(), (out[b, Nq + T - len(s):] - ref[Nq:]).abs().max().item())
print("max diff", md); assert md < 1e-10
