# Follows transformers models/esm/modeling_esm.py (EsmModel, ESM-2 style: rotary positions, token_dropout off):
# attention_mask 1 = residue, 0 = <pad> on the right; EsmEmbeddings also zeroes pad embeddings. Pad rows still attend
# to real residues and are discarded; each real residue must match its protein embedded alone without padding.
import torch
from transformers import EsmConfig, EsmModel

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

cfg = EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, position_embedding_type="rotary", token_dropout=False,
                pad_token_id=1, mask_token_id=32, emb_layer_norm_before=False, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
model = EsmModel(cfg, add_pooling_layer=False).eval().to(torch.float64)

cls, eos, pad = 0, 2, 1
lens = [11, 6, 9]  # residues per protein
seqs = [[cls] + torch.randint(4, 24, (n,)).tolist() + [eos] for n in lens]
L = max(len(s) for s in seqs)
input_ids = torch.full((len(seqs), L), pad)
attention_mask = torch.zeros(len(seqs), L, dtype=torch.long)
for i, s in enumerate(seqs):
    input_ids[i, : len(s)] = torch.tensor(s)
    attention_mask[i, : len(s)] = 1

with torch.no_grad():
    batched = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    diff = 0.0
    for i, s in enumerate(seqs):
        alone = model(input_ids=torch.tensor([s])).last_hidden_state
        diff = max(diff, (batched[i, : len(s)] - alone[0]).abs().max().item())
print(f"max abs diff (right-padded ESM-2 batch vs each protein alone): {diff:.3e}")
assert diff < 1e-10
