# Quiet: the shape of additive_mask_converted_again_mha_right_padded.py, correct. The model is handed the 0/1 padding
# mask and converts it once (`(1.0 - keep) * finfo.min` of a 0/1 mask: no overflow), made causal there; a left-padded
# batch, nn.MultiheadAttention (batch_first) with a (batch * heads, L, L) float attn_mask. The padded queries of row 1
# see no key (uniform weights over the finfo.min keys, never read): a note.
import torch
import torch.nn as nn

torch.manual_seed(0)
HEADS, DIM = 2, 16


class Decoder(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(40, DIM)
        self.attn = nn.ModuleList(nn.MultiheadAttention(DIM, HEADS, batch_first=True) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        b, t = input_ids.shape
        keep = torch.ones(t, t).tril()[None, None] * attention_mask[:, None, None, :].float()  # 0/1, causal
        mask = (1.0 - keep) * torch.finfo(x.dtype).min
        per_head = mask.expand(b, HEADS, t, t).reshape(b * HEADS, t, t)
        for attn in self.attn:
            out, _ = attn(x, x, x, attn_mask=per_head, need_weights=False)
            x = x + out
        return x


model = Decoder().eval()
input_ids = torch.tensor([[5, 9, 12, 7, 30, 22], [0, 0, 0, 17, 8, 3]])
attention_mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
with torch.no_grad():
    y = model(input_ids, attention_mask)
print(f"out[1, -1, :3]={[round(v, 4) for v in y[1, -1, :3].tolist()]}")
