# Follows HF transformers models/modernbert/modeling_modernbert.py: global layers every n layers use the padding
# mask only, the others a sliding window |i-j| <= local_attention//2 on top of it (ModernBertModel
# _update_attention_mask / sliding_window_mask).  Batch is right padded; each sequence alone must agree.
import torch
from transformers import ModernBertConfig, ModernBertModel

torch.manual_seed(0)
cfg = ModernBertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                       intermediate_size=48, max_position_embeddings=64, local_attention=6,
                       global_attn_every_n_layers=3, pad_token_id=0, attention_dropout=0.0,
                       mlp_dropout=0.0, embedding_dropout=0.0, attn_implementation="eager",
                       bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
model = ModernBertModel(cfg).double().eval()

lens = [9, 23, 16]
L = max(lens)
ids = torch.zeros(len(lens), L, dtype=torch.long)
att = torch.zeros(len(lens), L, dtype=torch.long)
seqs = []
for b, n in enumerate(lens):
    s = torch.randint(1, 60, (n,))
    seqs.append(s)
    ids[b, :n] = s
    att[b, :n] = 1

with torch.no_grad():
    out = model(input_ids=ids, attention_mask=att).last_hidden_state
    diff = 0.0
    for b, n in enumerate(lens):
        ref = model(input_ids=seqs[b][None], attention_mask=torch.ones(1, n, dtype=torch.long)).last_hidden_state
        diff = max(diff, (out[b, :n] - ref[0]).abs().max().item())
print("max |padded batch - each alone| =", diff)
assert diff < 1e-9
