# Follows transformers models/layoutlmv3/modeling_layoutlmv3.py LayoutLMv3Model.forward: text tokens (right padded, 0 = pad) are
# followed by [CLS]+image patches, whose visual_attention_mask is all ones and is cat'ed after the text mask, so the padding sits
# in the middle of the sequence; get_extended_attention_mask turns it into an additive bias on the 1-D/2-D relative-position bias.
import torch
from transformers import LayoutLMv3Config, LayoutLMv3Model

torch.manual_seed(0)
cfg = LayoutLMv3Config(vocab_size=50, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       coordinate_size=8, shape_size=8, input_size=32, patch_size=16, max_position_embeddings=40,
                       rel_pos_bins=8, max_rel_pos=16, rel_2d_pos_bins=16, max_rel_2d_pos=64,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = LayoutLMv3Model(cfg).eval().double()
lengths = [7, 3, 5]
T = max(lengths)
input_ids = torch.full((3, T), cfg.pad_token_id)
attention_mask = torch.zeros(3, T, dtype=torch.long)
bbox = torch.zeros(3, T, 4, dtype=torch.long)
for b, L in enumerate(lengths):
    input_ids[b, :L] = torch.randint(3, 50, (L,))
    input_ids[b, 0] = 0  # <s>
    attention_mask[b, :L] = 1
    x0 = torch.randint(0, 500, (L, 1)); y0 = torch.randint(0, 500, (L, 1))
    bbox[b, :L] = torch.cat([x0, y0, x0 + torch.randint(1, 400, (L, 1)), y0 + torch.randint(1, 400, (L, 1))], 1)
pixel_values = torch.randn(3, 3, 32, 32, dtype=torch.float64)
with torch.no_grad():
    out = model(input_ids=input_ids, bbox=bbox, attention_mask=attention_mask, pixel_values=pixel_values).last_hidden_state
    n_vis = out.shape[1] - T
    assert torch.isfinite(out).all()
    diff = 0.0
    for b, L in enumerate(lengths):
        alone = model(input_ids=input_ids[b:b + 1, :L], bbox=bbox[b:b + 1, :L],
                      pixel_values=pixel_values[b:b + 1]).last_hidden_state  # no padding, no mask
        got = torch.cat([out[b:b + 1, :L], out[b:b + 1, T:]], 1)
        diff = max(diff, (got - alone).abs().max().item())
print("visual tokens", n_vis, "| max |text padded mid-sequence - each document alone| =", diff)
assert diff < 1e-10
