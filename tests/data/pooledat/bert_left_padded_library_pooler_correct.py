# Correct: a tiny BertModel (transformers, built from its config) over a left-padded batch, eager attention, whose
# embeddings the program takes as the mean of last_hidden_state over the attention_mask. BertModel's own pooler reads
# `[:, 0]` of its encoder's output (handed the expanded 4-D key mask), a pad position of the left-padded row: the
# library's read, whose pooler_output the program never uses. Checked against each text run alone.
import torch
from transformers import BertConfig, BertModel

torch.manual_seed(0)
config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=16, attn_implementation="eager")
model = BertModel(config).eval()
texts = [[2, 7, 9, 11, 5, 3], [2, 8, 4, 3]]
width = max(map(len, texts))
input_ids = torch.tensor([[0] * (width - len(t)) + t for t in texts])
attention_mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in texts])
position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
with torch.no_grad():
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    mean = (hidden * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
    alone = torch.stack([model(input_ids=torch.tensor([t])).last_hidden_state[0].mean(0) for t in texts])
print("matches each text alone:", torch.allclose(mean, alone, atol=1e-5))
