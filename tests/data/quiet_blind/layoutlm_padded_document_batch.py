# Follows huggingface/transformers models/layoutlm/modeling_layoutlm.py LayoutLMModel.forward: attention_mask 1 = token,
# 0 = right padding (pad words carry bbox [0,0,0,0]); the model turns it into an additive (1-mask)*finfo.min bias.
# Checked: every real token's output in the padded batch equals that document run alone without padding.
import torch
from transformers import LayoutLMConfig, LayoutLMModel
torch.manual_seed(6)
cfg = LayoutLMConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=32, max_2d_position_embeddings=128)
model = LayoutLMModel(cfg).double().eval()
lens = [9, 4, 12]; S = max(lens)
ids = torch.zeros(3, S, dtype=torch.long); bbox = torch.zeros(3, S, 4, dtype=torch.long); am = torch.zeros(3, S, dtype=torch.long)
for i, n in enumerate(lens):
    ids[i, :n] = torch.randint(1, 60, (n,))
    x0 = torch.randint(0, 60, (n,)); y0 = torch.randint(0, 60, (n,))
    bbox[i, :n] = torch.stack([x0, y0, x0 + torch.randint(1, 60, (n,)), y0 + torch.randint(1, 60, (n,))], -1)
    am[i, :n] = 1
with torch.no_grad():
    out = model(input_ids=ids, bbox=bbox, attention_mask=am).last_hidden_state
    diff = max((model(input_ids=ids[i:i+1, :n], bbox=bbox[i:i+1, :n]).last_hidden_state[0] - out[i, :n]).abs().max().item()
               for i, n in enumerate(lens))
print("LayoutLM padded batch vs each document alone max diff", diff)
assert diff < 1e-10
