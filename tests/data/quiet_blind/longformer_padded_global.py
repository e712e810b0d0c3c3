# Follows HF transformers models/longformer/modeling_longformer.py (LongformerModel.forward, _pad_to_window_size,
# _merge_to_attention_mask): sliding window local attention, global attention on <s>, right padding to a batch.
import torch
from transformers import LongformerConfig, LongformerModel
torch.manual_seed(0)
cfg = LongformerConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       attention_window=[4, 4], max_position_embeddings=64, pad_token_id=1,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = LongformerModel(cfg).double().eval()
seqs = [torch.randint(3, 60, (n,)) for n in (13, 7, 10)]
T = max(len(s) for s in seqs)
ids = torch.full((len(seqs), T), 1); am = torch.zeros(len(seqs), T, dtype=torch.long)
gam = torch.zeros(len(seqs), T, dtype=torch.long)
for i, s in enumerate(seqs):
    ids[i, :len(s)] = s; am[i, :len(s)] = 1; gam[i, 0] = 1; gam[i, 2] = 1
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=am, global_attention_mask=gam).last_hidden_state
    diff = 0.0
    for i, s in enumerate(seqs):
        g = torch.zeros(1, len(s), dtype=torch.long); g[0, 0] = 1; g[0, 2] = 1
        r = model(input_ids=s[None], global_attention_mask=g).last_hidden_state[0]
        diff = max(diff, (r - out[i, :len(s)]).abs().max().item())
print("max diff", diff)
assert diff < 1e-6   # Longformer masks with a finite additive value, so ~1e-9 leaks are expected
