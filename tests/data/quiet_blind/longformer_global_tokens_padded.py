# Follows HF transformers models/longformer/modeling_longformer.py (LongformerModel.forward / _merge_to_attention_mask):
# attention_mask (1 keep, 0 pad) is merged with global_attention_mask into 0/1/2, padded to a multiple of the
# window, and turned into -inf / local / +global; the CLS token and a question span get global attention.
import torch
from transformers import LongformerConfig, LongformerModel

torch.manual_seed(0)
cfg = LongformerConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       intermediate_size=64, attention_window=4, max_position_embeddings=64,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)
model = LongformerModel(cfg).double().eval()

lens = [13, 20]
L = max(lens)
ids = torch.full((2, L), cfg.pad_token_id)
att = torch.zeros(2, L, dtype=torch.long)
glob = torch.zeros(2, L, dtype=torch.long)
seqs = []
for b, n in enumerate(lens):
    s = torch.randint(3, 50, (n,))
    s[0] = 0
    seqs.append(s)
    ids[b, :n] = s
    att[b, :n] = 1                 # right padding
    glob[b, 0] = 1                 # CLS global
    glob[b, 1:3] = 1               # a short "question" span is global too

with torch.no_grad():
    out = model(input_ids=ids, attention_mask=att, global_attention_mask=glob).last_hidden_state
    diff = 0.0
    for b, n in enumerate(lens):
        ref = model(input_ids=seqs[b][None], attention_mask=torch.ones(1, n, dtype=torch.long),
                    global_attention_mask=glob[b:b + 1, :n]).last_hidden_state
        diff = max(diff, (out[b, :n] - ref[0]).abs().max().item())
print("max |padded batch - each alone| =", diff)
assert diff < 1e-9
