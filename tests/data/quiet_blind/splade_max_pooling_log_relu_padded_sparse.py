# naver/splade (splade/models/transformer_rep.py, Splade.encode with agg="max"):
# values = max over tokens of log(1 + relu(MLM logits)) * attention_mask.unsqueeze(-1); padding rows are zeroed
# before the max, which is exact because log1p(relu(.)) >= 0 (a zero can never beat a real token's value).
import warnings; warnings.filterwarnings('ignore')
import torch
from transformers import BertConfig, BertForMaskedLM
torch.manual_seed(0)
cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = BertForMaskedLM(cfg).double().eval()

def encode(tokens):
    out = model(**tokens)["logits"]
    values, _ = torch.max(torch.log(1 + torch.relu(out)) * tokens["attention_mask"].unsqueeze(-1), dim=1)
    return values

with torch.no_grad():
    seqs = [[2, 5, 6, 7, 8, 9, 10, 11, 3], [2, 12, 3], [2, 13, 14, 15, 3]]
    L = max(map(len, seqs))
    ids = torch.zeros(len(seqs), L, dtype=torch.long); am = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s); am[i, :len(s)] = 1
    q = encode({"input_ids": ids, "attention_mask": am})
    ref = torch.stack([torch.log1p(torch.relu(model(input_ids=torch.tensor([s])).logits[0])).max(0).values for s in seqs])
    diff = (q - ref).abs().max().item()
    scores = q @ q.T; ref_scores = ref @ ref.T
    diff = max(diff, (scores - ref_scores).abs().max().item())
    print("max diff SPLADE masked max-pool (reps and dot scores), padded vs each alone:", diff)
    assert diff < 1e-10
