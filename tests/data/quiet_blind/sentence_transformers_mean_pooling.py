# Follows sentence-transformers models/Pooling.py mean pooling (input_mask_expanded, sum / clamp(min=1e-9)) on a
# transformers BertModel (random config). Right-padded batch vs each sentence alone, then F.normalize.
import torch, torch.nn.functional as F
from transformers import BertConfig, BertModel
torch.manual_seed(0)
cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=32, attn_implementation="sdpa")
m = BertModel(cfg).double().eval()
sents = [[2, 5, 9, 11, 3], [2, 7, 3], [2, 8, 8, 13, 14, 15, 3]]; L = 7
ids = torch.tensor([s + [0] * (L - len(s)) for s in sents]); am = (torch.arange(L)[None] < torch.tensor([len(s) for s in sents])[:, None]).long()
def mean_pool(tok, am):
    e = am.unsqueeze(-1).expand(tok.size()).to(tok.dtype)
    return torch.sum(tok * e, 1) / torch.clamp(e.sum(1), min=1e-9)
with torch.no_grad():
    emb = F.normalize(mean_pool(m(input_ids=ids, attention_mask=am).last_hidden_state, am), dim=-1)
    diff = 0.0
    for b, s in enumerate(sents):
        r = F.normalize(m(input_ids=torch.tensor([s])).last_hidden_state.mean(1), dim=-1)
        diff = max(diff, (r - emb[b]).abs().max().item())
print("max diff mean pooling padded vs alone", diff); assert diff < 1e-10
