# Follows huggingface/transformers models/esm/modeling_esm.py: EsmModel.predict_contacts multiplies the stacked attention maps by
# attention_mask on both query and key axes, EsmContactPredictionHead zeroes EOS rows/cols (tokens.ne(eos_idx)) and drops BOS/EOS;
# EsmEmbeddings' token_dropout rescales by the <mask> ratio over attention_mask.sum(-1). Right-padded batch vs each protein alone.
import torch
from transformers import EsmConfig, EsmModel

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
CLS, PAD, EOS, MASK = 0, 1, 2, 32
config = EsmConfig(
    vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, position_embedding_type="rotary", pad_token_id=PAD, mask_token_id=MASK,
    token_dropout=True, emb_layer_norm_before=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)
config._attn_implementation = "eager"  # attentions are returned and used by the contact head
model = EsmModel(config, add_pooling_layer=False).eval()
for p in model.contact_head.parameters():
    torch.nn.init.normal_(p, std=0.5)

proteins = [[5, 9, 13, MASK, 7, 20, 11, 6], [14, 8, 17], [4, MASK, 22, 10, 9]]
seqs = [[CLS] + p + [EOS] for p in proteins]
L = max(len(s) for s in seqs)
input_ids = torch.full((len(seqs), L), PAD)
attention_mask = torch.zeros(len(seqs), L, dtype=torch.long)
for i, s in enumerate(seqs):
    input_ids[i, : len(s)] = torch.tensor(s)
    attention_mask[i, : len(s)] = 1

with torch.no_grad():
    contacts = model.predict_contacts(input_ids, attention_mask)  # [B, L-2, L-2]
    hidden = model(input_ids, attention_mask=attention_mask).last_hidden_state
    d_c = d_h = 0.0
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        ref_c = model.predict_contacts(ids, torch.ones_like(ids))[0]
        ref_h = model(ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        n = len(proteins[i])
        d_c = max(d_c, (contacts[i, :n, :n] - ref_c).abs().max().item())
        d_h = max(d_h, (hidden[i, : len(s)] - ref_h).abs().max().item())
        # the padded part of the contact map is exactly what the head leaves there after zeroed attentions
        assert contacts[i].shape == (L - 2, L - 2)
print(f"hidden states, padded batch vs alone: max diff = {d_h:.3e}")
print(f"contact maps [:n, :n], padded batch vs alone: max diff = {d_c:.3e}")
worst = max(d_c, d_h)
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
