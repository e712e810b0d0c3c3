"""ByteDance-Seed/VeOmni#1158 (follow-up of #1139/#1140): under Ulysses sequence parallelism the Wan
sequence is tail-padded to a multiple of the SP size and WanModel.forward builds a mask for the padded
keys, but wrapped_flash_attention_3 took attention_mask only via **kwargs and never read it, so every
query also attended to the padded tail keys."""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

SP_SIZE = 4
NUM_HEADS = 4
HEAD_DIM = 8
DIM = NUM_HEADS * HEAD_DIM
SEQ_LEN = 29  # not divisible by SP_SIZE -> padded to 32


def _trim_kv_tail_padding(key, value, attention_mask):
    # attention_mask: [B, 1, 1, S] bool, True = real key
    keep = attention_mask[0, 0, 0]
    return key[:, :, keep], value[:, :, keep]


def wrapped_flash_attention_3(query, key, value, **kwargs):
    # stand-in for flash_attn_interface.flash_attn_func (no mask argument of its own), layout [B, H, S, D]
    if FIXED:
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is not None:
            key, value = _trim_kv_tail_padding(key, value, attention_mask)
    return F.scaled_dot_product_attention(query, key, value)


def all_to_all_seq_to_heads(shards):
    # each rank: [B, H, S/sp, D] -> [B, H/sp, S, D]
    full = torch.cat(shards, dim=2)
    return list(full.chunk(SP_SIZE, dim=1))


def all_to_all_heads_to_seq(shards):
    full = torch.cat(shards, dim=1)
    return list(full.chunk(SP_SIZE, dim=2))


class WanSelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(DIM, DIM)
        self.k = torch.nn.Linear(DIM, DIM)
        self.v = torch.nn.Linear(DIM, DIM)
        self.o = torch.nn.Linear(DIM, DIM)

    def heads(self, x):
        return x.view(x.shape[0], x.shape[1], NUM_HEADS, HEAD_DIM).transpose(1, 2)

    def forward_sp(self, x_shards, attention_mask):
        qs = [self.heads(self.q(x)) for x in x_shards]
        ks = [self.heads(self.k(x)) for x in x_shards]
        vs = [self.heads(self.v(x)) for x in x_shards]
        qs, ks, vs = all_to_all_seq_to_heads(qs), all_to_all_seq_to_heads(ks), all_to_all_seq_to_heads(vs)
        outs = [wrapped_flash_attention_3(q, k, v, attention_mask=attention_mask) for q, k, v in zip(qs, ks, vs)]
        outs = all_to_all_heads_to_seq(outs)
        return [self.o(o.transpose(1, 2).reshape(o.shape[0], o.shape[2], DIM)) for o in outs]


class WanModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = WanSelfAttention()

    def forward(self, x):
        seq_len = x.shape[1]
        pad = (-seq_len) % SP_SIZE
        x = F.pad(x, (0, 0, 0, pad))
        padded_len = x.shape[1]
        # mask for the Ulysses tail padding: True = real token
        attention_mask = (torch.arange(padded_len) < seq_len)[None, None, None, :]
        x_shards = list(x.chunk(SP_SIZE, dim=1))
        out_shards = self.self_attn.forward_sp(x_shards, attention_mask)
        return torch.cat(out_shards, dim=1)[:, :seq_len]


def main():
    model = WanModel().eval()
    x = torch.randn(1, SEQ_LEN, DIM)
    with torch.no_grad():
        out = model(x)
        a = model.self_attn
        ref = F.scaled_dot_product_attention(a.heads(a.q(x)), a.heads(a.k(x)), a.heads(a.v(x)))
        ref = a.o(ref.transpose(1, 2).reshape(1, SEQ_LEN, DIM))
    diff = (out - ref).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: max |ulysses(sp={SP_SIZE}) - unpadded single device| = {diff:.4e}")


if __name__ == "__main__":
    main()
