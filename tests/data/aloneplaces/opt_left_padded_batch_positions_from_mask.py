# Correct: OPT counts its learned positions from the attention_mask itself (cumsum - 1), so a left-padded batch handed
# no position_ids places each row from its first real token, as each prompt run alone. (No --fixed twin differs.)
import torch
from transformers import OPTConfig, OPTForCausalLM

config = OPTConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                   max_position_embeddings=32, word_embed_proj_dim=32, pad_token_id=1, attn_implementation="eager")
torch.manual_seed(0)
model = OPTForCausalLM(config).eval()
prompts = [[2, 10, 11, 12, 13, 14], [2, 15, 16], [2, 17, 18, 19]]
width = max(map(len, prompts))
ids = torch.tensor([[1] * (width - len(p)) + p for p in prompts])
mask = (ids != 1).long()
with torch.no_grad():
    batched = model(input_ids=ids, attention_mask=mask).logits
    worst = max((batched[i, width - len(p):] - model(input_ids=torch.tensor([p])).logits[0]).abs().max().item()
                for i, p in enumerate(prompts))
print(f"max |batched logits - each prompt alone|: {worst:.3e}")
