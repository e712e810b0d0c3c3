# Follows Pang-Yatian/Point-MAE models/Point_MAE.py, MaskTransformer._mask_center_rand / forward:
# bool_masked_pos is True = patch hidden; x_vis = tokens[~bool_masked_pos].reshape(B, -1, C), so the encoder only
# ever sees visible patches. Reference: all patches with a float -inf bias on hidden keys gives the same visible rows.
import torch, numpy as np
torch.manual_seed(3); np.random.seed(3); torch.set_default_dtype(torch.float64)
B, G, C, H, RATIO = 3, 16, 32, 4, 0.6

def _mask_center_rand(B, G, mask_ratio):
    num_mask = int(mask_ratio * G)
    overall_mask = np.zeros([B, G])
    for i in range(B):
        mask = np.hstack([np.zeros(G - num_mask), np.ones(num_mask)])
        np.random.shuffle(mask)
        overall_mask[i, :] = mask
    return torch.from_numpy(overall_mask).to(torch.bool)

layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(C, H, 2 * C, dropout=0.0, batch_first=True,
                                                              norm_first=True) for _ in range(2))
pos_embed = torch.nn.Sequential(torch.nn.Linear(3, C), torch.nn.GELU(), torch.nn.Linear(C, C))
center = torch.randn(B, G, 3)
group_input_tokens = torch.randn(B, G, C)
bool_masked_pos = _mask_center_rand(B, G, RATIO)

def encode(x, pos, bias=None):
    for blk in layers:
        x = blk(x + pos, src_mask=bias)
    return x

with torch.no_grad():
    x_vis = group_input_tokens[~bool_masked_pos].reshape(B, -1, C)
    masked_center = center[~bool_masked_pos].reshape(B, -1, 3)
    vis_out = encode(x_vis, pos_embed(masked_center))
    diff = 0.0
    for b in range(B):                     # reference: full patch set, hidden keys given -inf bias
        bias = torch.zeros(G, G).masked_fill(bool_masked_pos[b][None, :], float("-inf"))
        full = encode(group_input_tokens[b:b + 1], pos_embed(center[b:b + 1]), bias)
        diff = max(diff, (full[0][~bool_masked_pos[b]] - vis_out[b]).abs().max().item())
print("visible patches:", x_vis.shape[1], "of", G, " max diff gathered-visible vs biased-full:", diff)
assert diff < 1e-10
