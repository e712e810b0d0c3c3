# Follows huggingface/peft src/peft/peft_model.py PeftModelForCausalLM.forward for prefix tuning:
# prefix_attention_mask = ones(batch, num_virtual_tokens) is cat'ed LEFT of a left-padded attention_mask, and
# get_prompt(batch) supplies the virtual tokens as past_key_values; position_ids come from mask.cumsum like generate.
import torch
from transformers import LlamaConfig, LlamaModel
from transformers.cache_utils import DynamicCache
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
model = LlamaModel(cfg).double().eval()
nvt = 5; nkv = cfg.num_key_value_heads; hd = cfg.hidden_size // cfg.num_attention_heads
prefix_kv = torch.randn(cfg.num_hidden_layers, 2, nkv, nvt, hd, dtype=torch.float64)  # PrefixEncoder output, reshaped

def get_prompt(batch):
    c = DynamicCache()
    for l in range(cfg.num_hidden_layers):
        c.update(prefix_kv[l, 0].expand(batch, -1, -1, -1).clone(), prefix_kv[l, 1].expand(batch, -1, -1, -1).clone(), l)
    return c

def peft_forward(input_ids, attention_mask):
    B = input_ids.shape[0]
    prefix_attention_mask = torch.ones(B, nvt, dtype=attention_mask.dtype)
    attention_mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 1)[:, -input_ids.shape[1]:]
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 past_key_values=get_prompt(B), use_cache=True).last_hidden_state

lens = [7, 3, 5]; T = max(lens)
seqs = [torch.randint(1, 50, (n,)) for n in lens]
ids = torch.zeros(3, T, dtype=torch.long); am = torch.zeros(3, T, dtype=torch.long)
for b, s in enumerate(seqs):
    ids[b, T - len(s):] = s; am[b, T - len(s):] = 1                 # left padding
with torch.no_grad():
    out = peft_forward(ids, am)
    md = 0.0
    for b, s in enumerate(seqs):
        ref = model(input_ids=s[None], past_key_values=get_prompt(1), use_cache=True).last_hidden_state  # default positions nvt..
        md = max(md, (out[b, T - len(s):] - ref[0]).abs().max().item())   # left-pad rows discarded
print("max diff", md); assert md < 1e-10
