"""Packed BERT fine-tuning (Graphcore examples, "packedBERT").

Follows graphcore/examples nlp/bert (packed sequence classification: the packing
utilities emit `attention_mask` holding sample numbers 1..k and 0 for padding, and
`position_ids` restarting at 0 for each sample; the model builds an extended mask
from `mask[:, :, None] == mask[:, None, :]`; not pinned). Attention is bidirectional
inside each sample. Padding slots (number 0) form their own group, so their rows stay
finite; their outputs are never read. Each sample's CLS is pooled for its label.
Reference: every sample run alone through the same BERT, unpadded.
"""
import torch
import torch.nn.functional as F
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings

torch.manual_seed(0)
cfg = BertConfig(vocab_size=60, hidden_size=32, num_attention_heads=4,
                 max_position_embeddings=32, type_vocab_size=2)
emb = BertEmbeddings(cfg).eval()
wq, wk, wv = (torch.nn.Linear(32, 32) for _ in range(3))
cls_head = torch.nn.Linear(32, 3)
H, HD = 4, 8


def encoder(x, allowed):
    b, s, _ = x.shape
    q, k, v = (w(x).view(b, s, H, HD).transpose(1, 2) for w in (wq, wk, wv))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    return x + y.transpose(1, 2).reshape(b, s, 32)


CLS, SEP = 1, 2
samples = [torch.randint(3, 60, (n,)) for n in (4, 6, 3, 5, 2)]
samples = [torch.cat([torch.tensor([CLS]), s, torch.tensor([SEP])]) for s in samples]
# pack greedily into rows of 16: [6, 8] and [5, 7, 4] -> padding at the end
rows = [[0, 1], [2, 3, 4]]
S = 16
input_ids = torch.zeros(2, S, dtype=torch.long)
sample_no = torch.zeros(2, S, dtype=torch.long)     # 0 = padding
position_ids = torch.zeros(2, S, dtype=torch.long)
cls_positions = []
for r, members in enumerate(rows):
    at = 0
    for n_in_row, idx in enumerate(members, start=1):
        t = samples[idx]
        input_ids[r, at:at + len(t)] = t
        sample_no[r, at:at + len(t)] = n_in_row
        position_ids[r, at:at + len(t)] = torch.arange(len(t))
        cls_positions.append((r, at, idx))
        at += len(t)

with torch.no_grad():
    x = emb(input_ids=input_ids, position_ids=position_ids,
            token_type_ids=torch.zeros_like(input_ids))
    allowed = sample_no[:, :, None] == sample_no[:, None, :]
    out = encoder(x, allowed)
    logits_packed = {idx: cls_head(out[r, at]) for r, at, idx in cls_positions}

    worst = 0.0
    for idx, t in enumerate(samples):
        xi = emb(input_ids=t[None], token_type_ids=torch.zeros_like(t[None]))
        oi = encoder(xi, torch.ones(1, len(t), len(t), dtype=torch.bool))
        worst = max(worst, (cls_head(oi[0, 0]) - logits_packed[idx]).abs().max().item())

print(f"packed CLS logits vs one sample at a time, max diff {worst:.2e}")
assert worst < 1e-5
