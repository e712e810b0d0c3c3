# Follows LLaMA-Factory src/llamafactory/data/collator.py `prepare_4d_attention_mask` (and transformers
# tests/test_modeling_common.py `test_custom_4d_attention_mask`): packed docs get a block-diagonal causal
# float bias (0 = attend, finfo.min = blocked) of shape (B,1,T,T), plus position_ids restarting per doc.
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(cfg).float().eval()  # float32: eager softmax runs in float32, so a float64
# finfo.min bias would overflow to -inf there and make the all-blocked padding rows NaN


def prepare_4d_attention_mask(mask_with_indices, dtype):
    # [[1,1,2,2,2,0]] -> (B,1,T,T) float bias; doc index 0 = padding, attends nowhere useful
    b, t = mask_with_indices.shape
    min_dtype = torch.finfo(dtype).min
    zero = torch.tensor(0, dtype=dtype)
    non_padding = (mask_with_indices != 0).unsqueeze(1).unsqueeze(2)
    idx = mask_with_indices.unsqueeze(1).unsqueeze(2)            # keys
    idx_t = mask_with_indices.unsqueeze(1).unsqueeze(3)          # queries
    tril = torch.tril(torch.ones((t, t), dtype=torch.bool))
    keep = (idx == idx_t) & non_padding & tril
    return torch.where(keep, zero, min_dtype)


docs = [torch.randint(0, 97, (n,)) for n in (5, 7, 4)]
pad = 3
ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)]).unsqueeze(0)
seg = torch.cat([torch.full((len(d),), i + 1) for i, d in enumerate(docs)] + [torch.zeros(pad, dtype=torch.long)]).unsqueeze(0)
pos = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(pad)]).unsqueeze(0)
mask4d = prepare_4d_attention_mask(seg, torch.float32)

worst = 0.0
for impl in ("eager", "sdpa"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=mask4d, position_ids=pos).logits[0]
        off = 0
        for d in docs:
            alone = model(input_ids=d.unsqueeze(0)).logits[0]
            diff = (packed[off:off + len(d)] - alone).abs().max().item()
            assert diff == diff, "NaN"
            worst = max(worst, diff)
            off += len(d)
    # padding rows (off:) are discarded: they are never compared
print(f"max |packed - alone| = {worst:.3e}")
assert torch.isfinite(packed).all() and worst < 1e-5
