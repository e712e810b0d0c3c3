# unslothai/unsloth#3034's bug written another way: a decoder's generation wrapper already turns the 0/1 padding mask
# into a 4-D additive one (0 kept, finfo.min masked, causal), and the model's forward converts whatever it is handed
# again, as if it were 0/1: `(1.0 - mask) * finfo.min` makes every kept cell finfo.min and every masked one -inf (past
# the range), so no key is left unmasked and the attention is uniform over the kept keys, whatever the scores. The
# model runs nn.MultiheadAttention (batch_first) with a (batch * heads, L, L) float attn_mask; a right-padded batch.
# The fix converts a 2-D mask only and passes a 4-D one on as it is.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
HEADS, DIM = 2, 16


def additive_4d(keep_2d, dtype=torch.float32):
    """The wrapper's: (b, 1, t, t) additive, causal and padding, 0 where kept and finfo.min where masked."""
    t = keep_2d.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    keep = causal[None, None] & keep_2d[:, None, None, :].bool()
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


class Decoder(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(40, DIM)
        self.attn = nn.ModuleList(nn.MultiheadAttention(DIM, HEADS, batch_first=True) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        mask = attention_mask
        if mask.dim() == 2 or not FIXED:  # the bug: a 4-D additive mask converted as if it were 0/1
            mask = (1.0 - mask.float()) * torch.finfo(x.dtype).min
            if mask.dim() == 2:  # (only a 2-D one is made causal and 4-D here; the wrapper's already is)
                mask = additive_4d(attention_mask, x.dtype)
        b, t = input_ids.shape
        per_head = mask.expand(b, HEADS, t, t).reshape(b * HEADS, t, t)
        for attn in self.attn:
            out, _ = attn(x, x, x, attn_mask=per_head, need_weights=False)
            x = x + out
        return x


def generate_step(model, input_ids, attention_mask):  # the wrapper: it prepares the 4-D mask itself
    return model(input_ids, additive_4d(attention_mask))


model = Decoder().eval()
input_ids = torch.tensor([[5, 9, 12, 7, 30, 22], [17, 8, 3, 0, 0, 0]])
attention_mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
with torch.no_grad():
    y = generate_step(model, input_ids, attention_mask)
print(f"fixed={FIXED} out[1, 2, :3]={[round(v, 4) for v in y[1, 2, :3].tolist()]}")
