# Follows transformers src/transformers/models/modernbert/modeling_modernbert.py (bidirectional mask plus
# sliding-window mask for local layers, `local_attention` total width) used as in its sequence-classification
# tests with padded batches: pad keys are masked, pad query rows are computed but discarded.
import torch
from transformers import ModernBertConfig, ModernBertModel

torch.manual_seed(10)
cfg = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                       num_attention_heads=4, local_attention=4, global_attn_every_n_layers=2,
                       max_position_embeddings=64, pad_token_id=0, bos_token_id=1, cls_token_id=1, sep_token_id=2, embedding_dropout=0.0,
                       attention_dropout=0.0, mlp_dropout=0.0)
model = ModernBertModel(cfg).float().eval()  # float32: eager softmax is float32, a float64 min would be -inf

seqs = [torch.randint(1, 64, (n,)) for n in (3, 12, 8)]
T = max(len(s) for s in seqs)
ids = torch.zeros(3, T, dtype=torch.long)
am = torch.zeros(3, T, dtype=torch.long)
for i, s in enumerate(seqs):
    ids[i, :len(s)] = s
    am[i, :len(s)] = 1

worst = 0.0
outs = {}
for impl in ("sdpa", "eager"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        h = model(input_ids=ids, attention_mask=am).last_hidden_state
        outs[impl] = h
        for i, s in enumerate(seqs):
            alone = model(input_ids=s.unsqueeze(0)).last_hidden_state[0]
            d = (h[i, :len(s)] - alone).abs().max().item()     # padded rows discarded
            assert d == d, "NaN"
            worst = max(worst, d)
valid = am.bool()
d = (outs["sdpa"][valid] - outs["eager"][valid]).abs().max().item()
worst = max(worst, d)
print(f"max |padded batch - alone, sdpa - eager| = {worst:.3e}")
assert worst < 1e-5
