# Citation: huggingface/transformers src/transformers/models/esm/modeling_esm.py (EsmModel.forward builds the extended
#   attention mask from attention_mask; EsmEmbeddings applies token-dropout rescaling and zeroes padded embeddings).
# Masking: a batch of proteins of different lengths, right-padded with <pad>=1 after <eos>; attention_mask (1 keep /
#   0 pad) becomes an additive bidirectional key mask, so no residue attends to padding; pad rows are ignored by the
#   MLM loss (-100 labels). Rotary positions make padding placement irrelevant for valid tokens.
import torch
from transformers import EsmConfig, EsmForMaskedLM

torch.manual_seed(0)
config = EsmConfig(vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                   pad_token_id=1, mask_token_id=32, position_embedding_type="rotary", token_dropout=True,
                   max_position_embeddings=64, emb_layer_norm_before=False)
model = EsmForMaskedLM(config)
lengths = [14, 9, 5]
L = max(lengths) + 2
input_ids = torch.full((3, L), 1)
attention_mask = torch.zeros(3, L, dtype=torch.long)
for i, n in enumerate(lengths):
    input_ids[i, 0] = 0  # <cls>
    input_ids[i, 1:n + 1] = torch.randint(4, 24, (n,))
    input_ids[i, n + 1] = 2  # <eos>
    attention_mask[i, :n + 2] = 1
labels = torch.full_like(input_ids, -100)
masked = (torch.rand(3, L) < 0.15) & (input_ids > 3)
masked[:, 3] = True
labels[masked] = input_ids[masked]
input_ids = input_ids.masked_fill(masked, 32)
out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
out.loss.backward()
print(f"mlm loss {out.loss.item():.4f}")
