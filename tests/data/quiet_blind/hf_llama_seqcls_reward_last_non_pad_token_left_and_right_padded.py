# transformers LlamaForSequenceClassification.forward (models/llama/modeling_llama.py via GenericForSequenceClassification):
# non_pad_mask = (input_ids != pad_token_id); last_non_pad_token = (token_indices * non_pad_mask).argmax(-1) picks the
# last real token whether the batch is left- or right-padded; padded logit rows are computed and then discarded.
import warnings; warnings.filterwarnings('ignore')
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification
torch.manual_seed(0)
PAD = 0
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=PAD)
cfg._attn_implementation = "sdpa"
model = LlamaForSequenceClassification(cfg).double().eval()
seqs = [[1, 5, 6, 7, 8, 9, 2], [1, 10, 11, 2], [1, 12, 2]]

def batch(side):
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), PAD); am = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        sl = slice(L - len(s), L) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s); am[i, sl] = 1
    pos = (am.cumsum(-1) - 1).clamp(min=0)  # reward-model trainers pass position_ids from the mask when left-padded
    return ids, am, pos

with torch.no_grad():
    ref = torch.cat([model(input_ids=torch.tensor([s])).logits for s in seqs])[:, 0]
    diffs = []
    for side in ("right", "left"):
        ids, am, pos = batch(side)
        r = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, 0]
        diffs.append((r - ref).abs().max().item())
    print("max diff reward (right-padded, left-padded) vs each alone:", diffs)
    assert max(diffs) < 1e-10
