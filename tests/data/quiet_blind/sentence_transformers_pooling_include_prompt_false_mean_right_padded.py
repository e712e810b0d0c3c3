# sentence-transformers (sentence_transformers/models/Pooling.py, Pooling.forward with include_prompt=False):
# the prompt tokens still go through the encoder (attention_mask keeps them), but the pooling mask zeroes
# attention_mask[:, :prompt_length] so the mean is over the real, non-prompt tokens only (padding on the right).
import warnings; warnings.filterwarnings('ignore')
import torch
from transformers import BertConfig, BertModel
torch.manual_seed(0)
cfg = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = BertModel(cfg).double().eval()
prompt = [2, 40, 41, 42]  # "[CLS] query :" style prefix, prompt_length = 4
texts = [[5, 6, 7, 3], [8, 9, 10, 11, 12, 13, 3], [14, 3]]

def pool(token_embeddings, attention_mask, prompt_length):
    attention_mask = attention_mask.clone()
    attention_mask[:, :prompt_length] = 0  # Pooling.forward: include_prompt=False
    m = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
    return (token_embeddings * m).sum(1) / torch.clamp(m.sum(1), min=1e-9)

with torch.no_grad():
    seqs = [prompt + t for t in texts]
    L = max(map(len, seqs))
    ids = torch.zeros(len(seqs), L, dtype=torch.long); am = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s); am[i, :len(s)] = 1
    out = model(input_ids=ids, attention_mask=am).last_hidden_state
    batched = pool(out, am, len(prompt))
    ref = torch.stack([model(input_ids=torch.tensor([s])).last_hidden_state[0, len(prompt):].mean(0) for s in seqs])
    diff = (batched - ref).abs().max().item()
    print("max diff prompt-excluded mean pool, padded batch vs each alone:", diff)
    assert diff < 1e-10
