# InternLM/InternEvo#316 ("fix(shard.py): fix isp unpack data indexes err in rotary emb", merged).
# Bug: with unpacked data (use_packed_dataset=False) the data path popped the `indexes` field (the
# per-token positions). The rotary embedding then ran with its default offsets=0. Under ISP sequence
# parallelism the sequence dimension is split across ranks *before* q/k are rotated, so every rank's
# shard was rotated as positions 0..S/P-1: the second half of the sequence got the first half's
# positions, then the all-to-all regathered the sequence and causal attention ran on wrong positions.
# Fix: keep `indexes`, split it along the sequence like the hidden states (core/parallel/shard.py),
# and pass the shard's indexes to the rotary embedding as its offsets.
# Two ISP ranks are simulated in one process; the all-to-all is a concatenation along the sequence.
import sys
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

SP_SIZE = 2
B, S, H, D = 1, 8, 2, 16
HIDDEN = H * D


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def _cos_sin(self, positions):
        freqs = torch.outer(positions.float(), self.inv_freq)
        return freqs.cos(), freqs.sin()

    def _apply(self_, x, cos, sin):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, qkv, indexes=0, seqlen=None):
        # InternEvo: indexes is either an int offset (default 0) or a tensor of positions
        seqlen = qkv.shape[1] if seqlen is None else seqlen
        if isinstance(indexes, int):
            positions = torch.arange(indexes, indexes + seqlen)
        else:
            positions = indexes
        cos, sin = self._cos_sin(positions)
        q = self._apply(qkv[:, :, 0], cos, sin)
        k = self._apply(qkv[:, :, 1], cos, sin)
        return torch.stack([q, k, qkv[:, :, 2]], dim=2)


class MHA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.Wqkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.rotary_emb = RotaryEmbedding(D)

    def rotate_local(self, x, **kwargs):
        qkv = self.Wqkv(x).view(x.shape[0], x.shape[1], 3, H, D)
        indexes = kwargs.get("indexes", 0)
        return self.rotary_emb(qkv, indexes=indexes, seqlen=x.shape[1])

    def attend(self, qkv_full):
        q, k, v = (qkv_full[:, :, i].transpose(1, 2) for i in range(3))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(o.transpose(1, 2).reshape(o.shape[0], -1, HIDDEN))


def split_forward_gather_backward(t, dim, rank):
    return t.chunk(SP_SIZE, dim=dim)[rank]


def unpack_data(batch):
    # data path for use_packed_dataset=False
    data = dict(batch)
    if FIXED:
        indexes = data["indexes"]
    else:
        indexes = data.pop("indexes")
        indexes = None
    return data, indexes


mha = MHA().eval()
hidden_states = torch.randn(B, S, HIDDEN)
batch = {"input_ids": torch.arange(S)[None], "indexes": torch.arange(S)}

data, indexes = unpack_data(batch)
shards = []
with torch.no_grad():
    for rank in range(SP_SIZE):
        x_local = split_forward_gather_backward(hidden_states, 1, rank)
        kwargs = {}
        if indexes is not None:
            kwargs["indexes"] = split_forward_gather_backward(indexes, 0, rank)
        shards.append(mha.rotate_local(x_local, **kwargs))
    qkv_full = torch.cat(shards, dim=1)  # all-to-all: sequence regathered, heads whole
    out = mha.attend(qkv_full)

print("output shape", tuple(out.shape))
print("last token out[:4]", [round(v, 4) for v in out[0, -1, :4].tolist()])
