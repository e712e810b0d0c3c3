# Correct: transformers' own GPT-Neo (a tiny random model) whose config alternates global and local layers with a
# window of 4 keys, generating from a left-padded batch (eager attention, the one GPT-Neo has): its local layers keep
# k > q - window_size (modeling_gpt_neo.py), so no real query reads more than 4 keys there. --fixed runs the same.
import torch
from transformers import GPTNeoConfig, GPTNeoForCausalLM

torch.manual_seed(0)
for implementation in ("eager",):
    config = GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64,
                          attention_types=[[["global", "local"], 2]], window_size=4, max_position_embeddings=64,
                          pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config._attn_implementation = implementation
    model = GPTNeoForCausalLM(config).eval()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]])
    mask = (ids != 0).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    print(implementation, out[:, ids.shape[1]:].tolist())
