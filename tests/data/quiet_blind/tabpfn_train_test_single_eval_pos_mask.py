# Follows automl/TabPFN (v1) tabpfn/transformer.py TransformerModel.generate_D_q_matrix + utils.bool_mask_to_att_mask: rows of a
# table are the sequence; every row sees all training rows and itself (eye), test rows never see other test rows, and the bool
# keep-mask is turned into a float mask (-inf / 0.0) for nn.TransformerEncoder's src_mask.
import torch
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def bool_mask_to_att_mask(mask):
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0)).to(torch.float64)


def generate_D_q_matrix(sz, query_size):
    train_size = sz - query_size
    mask = torch.zeros(sz, sz) == 0
    mask[:, train_size:].zero_()
    mask |= torch.eye(sz) == 1
    return bool_mask_to_att_mask(mask)


n_feat, emsize, n_train, n_test = 5, 32, 9, 6
encoder = nn.Linear(n_feat, emsize)
y_encoder = nn.Linear(1, emsize)
layer = nn.TransformerEncoderLayer(emsize, 4, 64, dropout=0.0, batch_first=False)
transformer = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
decoder = nn.Linear(emsize, 3)
X = torch.randn(n_train + n_test, 2, n_feat)                  # [seq(rows), batch(datasets), features]
y = torch.randint(0, 3, (n_train, 2, 1)).to(torch.float64)
single_eval_pos = n_train
with torch.no_grad():
    x_src = encoder(X)
    train_x = x_src[:single_eval_pos] + y_encoder(y)          # labels only added to the training rows
    src = torch.cat([train_x, x_src[single_eval_pos:]], 0)
    src_mask = generate_D_q_matrix(len(src), len(src) - single_eval_pos)
    out = decoder(transformer(src, mask=src_mask))[single_eval_pos:]
    # reference, no mask anywhere: training rows run alone layer by layer; each test row is run together with the
    # training rows' states of the previous layer and only its own (last) output row is kept.
    diff = 0.0
    for t in range(n_test):
        tr, te = train_x, x_src[single_eval_pos + t:single_eval_pos + t + 1]
        for lyr in transformer.layers:
            te = lyr(torch.cat([tr, te], 0))[-1:]
            tr = lyr(tr)
        diff = max(diff, (out[t] - decoder(te)[0]).abs().max().item())
print("max |test rows under D_q mask - each test row alone with the train set| =", diff)
assert diff < 1e-10
