# NeMo FastPitch transformer (NVIDIA/NeMo#5450, "JOC Optimization in FastPitch": "Correcting dimensions, it will give
# wrong results in case of >1 attention heads"): MultiHeadAttn laid q/k/v out batch-major (permute(0, 2, 1, 3)) but
# tiled the padding mask head-major (attn_mask.repeat(n_head, ...)) and read attn_vec back head-major, so with B > 1
# each head got another utterance's padding mask (and output heads were shuffled across the batch).
import sys
from typing import Optional
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def mask_from_lens(lens, max_len: Optional[int] = None):
    if max_len is None:
        max_len = lens.max()
    ids = torch.arange(0, max_len, device=lens.device, dtype=lens.dtype)
    mask = torch.lt(ids, lens.unsqueeze(1))
    return mask


def regulate_len(durations, enc_out, pace: float = 1.0):
    """Length regulator of nemo/collections/tts/modules/fastpitch.py: repeat encoder frames by durations."""
    dtype = enc_out.dtype
    reps = durations.float() / pace
    reps = (reps + 0.5).floor().long()
    dec_lens = reps.sum(dim=1)
    max_len = dec_lens.max()
    reps_cumsum = torch.cumsum(F.pad(reps, (1, 0, 0, 0), value=0.0), dim=1)[:, None, :]
    reps_cumsum = reps_cumsum.to(dtype=dtype)
    range_ = torch.arange(max_len)[None, :, None]
    mult = (reps_cumsum[:, :, :-1] <= range_) & (reps_cumsum[:, :, 1:] > range_)
    enc_rep = torch.matmul(mult.to(dtype), enc_out)
    return enc_rep, dec_lens


class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super().__init__()
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, pos_seq):
        sinusoid_inp = torch.matmul(torch.unsqueeze(pos_seq, -1), torch.unsqueeze(self.inv_freq, 0))
        return torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=1)[None, :, :]


class PositionwiseConvFF(nn.Module):
    def __init__(self, d_model, d_inner, kernel_size, dropout, pre_lnorm=False):
        super().__init__()
        self.CoreNet = nn.Sequential(
            nn.Conv1d(d_model, d_inner, kernel_size, 1, (kernel_size // 2)),
            nn.ReLU(),
            nn.Conv1d(d_inner, d_model, kernel_size, 1, (kernel_size // 2)),
            nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inp):
        core_out = self.CoreNet(inp.transpose(1, 2)).transpose(1, 2)
        return self.layer_norm(inp + core_out)


class MultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0.1, pre_lnorm=False):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.scale = 1 / (d_head ** 0.5)
        self.pre_lnorm = pre_lnorm
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inp, attn_mask=None):
        residual = inp
        n_head, d_head = self.n_head, self.d_head

        head_q, head_k, head_v = torch.chunk(self.qkv_net(inp), 3, dim=2)
        head_q = head_q.view(inp.size(0), inp.size(1), n_head, d_head)
        head_k = head_k.view(inp.size(0), inp.size(1), n_head, d_head)
        head_v = head_v.view(inp.size(0), inp.size(1), n_head, d_head)

        if FIXED:
            # reshape to n_head X B, X T X d_head
            q = head_q.permute(2, 0, 1, 3).reshape(-1, inp.size(1), d_head)
            k = head_k.permute(2, 0, 1, 3).reshape(-1, inp.size(1), d_head)
            v = head_v.permute(2, 0, 1, 3).reshape(-1, inp.size(1), d_head)
        else:
            q = head_q.permute(0, 2, 1, 3).reshape(-1, inp.size(1), d_head)
            k = head_k.permute(0, 2, 1, 3).reshape(-1, inp.size(1), d_head)
            v = head_v.permute(0, 2, 1, 3).reshape(-1, inp.size(1), d_head)

        attn_score = torch.bmm(q, k.transpose(1, 2))
        attn_score.mul_(self.scale)

        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(1).to(attn_score.dtype)
            attn_mask = attn_mask.repeat(n_head, attn_mask.size(2), 1)
            attn_score.masked_fill_(attn_mask.to(torch.bool), -float("inf"))

        attn_prob = F.softmax(attn_score, dim=2)
        attn_prob = self.dropatt(attn_prob)
        attn_vec = torch.bmm(attn_prob, v)

        attn_vec = attn_vec.view(n_head, inp.size(0), inp.size(1), d_head)
        attn_vec = attn_vec.permute(1, 2, 0, 3).contiguous().view(inp.size(0), inp.size(1), n_head * d_head)

        attn_out = self.drop(self.o_net(attn_vec))
        return self.layer_norm(residual + attn_out)


class TransformerLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, kernel_size, dropout, **kwargs):
        super().__init__()
        self.dec_attn = MultiHeadAttn(n_head, d_model, d_head, dropout, **kwargs)
        self.pos_ff = PositionwiseConvFF(d_model, d_inner, kernel_size, dropout, pre_lnorm=kwargs.get("pre_lnorm"))

    def forward(self, dec_inp, mask=None):
        output = self.dec_attn(dec_inp, attn_mask=~mask.squeeze(2))
        output *= mask
        output = self.pos_ff(output)
        output *= mask
        return output


class FFTransformerDecoder(nn.Module):
    def __init__(self, n_layer, n_head, d_model, d_head, d_inner, kernel_size, dropout, dropatt, dropemb=0.0, pre_lnorm=False):
        super().__init__()
        self.pos_emb = PositionalEmbedding(d_model)
        self.drop = nn.Dropout(dropemb)
        self.layers = nn.ModuleList(
            [TransformerLayer(n_head, d_model, d_head, d_inner, kernel_size, dropout, dropatt=dropatt, pre_lnorm=pre_lnorm)
             for _ in range(n_layer)]
        )

    def forward(self, input, seq_lens, conditioning=0):
        return self._forward(input, mask_from_lens(seq_lens).unsqueeze(2), conditioning)

    def _forward(self, inp, mask, conditioning):
        sequence_positions = torch.arange(inp.size(1)).to(inp.dtype)
        pos_emb = self.pos_emb(sequence_positions) * mask
        out = self.drop(inp + pos_emb + conditioning)
        for layer in self.layers:
            out = layer(out, mask=mask)
        return out, mask


class FFTransformerEncoder(FFTransformerDecoder):
    def __init__(self, *args, n_embed=None, d_embed=None, padding_idx=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.padding_idx = padding_idx
        self.word_emb = nn.Embedding(n_embed, d_embed or args[2], padding_idx=self.padding_idx)

    def forward(self, input, conditioning=0):
        return self._forward(self.word_emb(input), (input != self.padding_idx).unsqueeze(2), conditioning)  # (B, L, 1)


# kernel_size=1 so the conv feed-forward does not mix time steps; only attention can leak across padding / batch
cfg = dict(n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, kernel_size=1, dropout=0.0, dropatt=0.0)
encoder = FFTransformerEncoder(*cfg.values(), n_embed=40, padding_idx=0).eval()
decoder = FFTransformerDecoder(*cfg.values()).eval()

# FastPitch inference path: text encoder -> length regulator (durations) -> decoder masked by regulated lengths
text = torch.tensor([[5, 9, 12, 3, 7, 21, 14, 2], [8, 2, 26, 11, 0, 0, 0, 0]])
durs = torch.tensor([[2, 1, 3, 2, 1, 2, 1, 2], [3, 2, 1, 2, 0, 0, 0, 0]])


def fastpitch_infer(text, durs):
    enc_out, enc_mask = encoder(input=text)
    len_regulated, dec_lens = regulate_len(durs, enc_out)
    dec_out, _ = decoder(input=len_regulated, seq_lens=dec_lens)
    return dec_out, dec_lens


with torch.no_grad():
    batched, dec_lens = fastpitch_infer(text, durs)
    max_diff = 0.0
    for b in range(text.shape[0]):
        n_tok = int((text[b] != 0).sum())
        alone, _ = fastpitch_infer(text[b:b + 1, :n_tok], durs[b:b + 1, :n_tok])
        max_diff = max(max_diff, (batched[b, : dec_lens[b]] - alone[0]).abs().max().item())
print(f"max |batched - per-utterance| decoder output = {max_diff:.6f}")
