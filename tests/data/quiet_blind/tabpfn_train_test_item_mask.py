# Follows automl/TabPFN (v1) tabpfn/transformer.py + utils.py generate_D_q_matrix / bool_mask_to_att_mask: items before
# single_eval_pos (train) attend to all train items; test items attend to train items and ONLY themselves (diagonal),
# never to other test items. Bool keep-mask is flipped into a float -inf bias for nn.MultiheadAttention. Checked per test item.
import torch, torch.nn as nn
torch.manual_seed(5)
D, NTR, NTE = 32, 7, 5
def generate_D_q_matrix(sz, query_size):
    train_size = sz - query_size
    mask = torch.zeros(sz, sz) == 0
    mask[:, train_size:].zero_()
    mask |= torch.eye(sz) == 1
    return mask
def bool_mask_to_att_mask(mask):
    return mask.double().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
mha = nn.MultiheadAttention(D, 4, dtype=torch.float64).eval()
items = torch.randn(NTR + NTE, 1, D, dtype=torch.float64)   # [seq, batch, d] like TabPFN
src_mask = bool_mask_to_att_mask(generate_D_q_matrix(NTR + NTE, NTE))
with torch.no_grad():
    out = mha(items, items, items, attn_mask=src_mask, need_weights=False)[0]
    diffs = []
    for j in range(NTE):   # reference: train set + this one test item, plain (train rows' mask is the same train-only block)
        sub = torch.cat([items[:NTR], items[NTR + j:NTR + j + 1]])
        m = torch.zeros(NTR + 1, NTR + 1, dtype=torch.float64); m[:NTR, NTR] = float('-inf')
        r = mha(sub, sub, sub, attn_mask=m, need_weights=False)[0]
        diffs.append((r[-1] - out[NTR + j]).abs().max()); diffs.append((r[:NTR] - out[:NTR]).abs().max())
diff = max(diffs).item()
print("TabPFN train/test mask vs per-test-item runs max diff", diff)
assert diff < 1e-12
