# espnet/espnet#1291, fixed by espnet/espnet#1331 ("Fix TTS transformer attention weight calculation in inference").
# espnet/nets/pytorch_backend/e2e_tts_transformer.py, Transformer.inference: the decoder runs step by step with its
# self-attention cache (decoder.forward_one_step), so each layer's MultiHeadedAttention keeps in `self.attn` only the
# scores of the newest query. Before the fix the source-attention weights were read once, after the loop, from
# `m.attn` of every "src" attention: the returned alignment is the last step's row only.
# The fix reads them after each step and concatenates along the query axis, giving one row per generated frame.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None

    def forward(self, query, key, value, mask):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.d_k ** 0.5
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.attn, v)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)


class DecoderLayer(nn.Module):
    def __init__(self, size, n_head):
        super().__init__()
        self.self_attn = MultiHeadedAttention(n_head, size)
        self.src_attn = MultiHeadedAttention(n_head, size)
        self.feed_forward = nn.Sequential(nn.Linear(size, 2 * size), nn.ReLU(), nn.Linear(2 * size, size))
        self.norm1 = nn.LayerNorm(size)
        self.norm2 = nn.LayerNorm(size)
        self.norm3 = nn.LayerNorm(size)

    def forward(self, tgt, tgt_mask, memory, memory_mask, cache=None):
        residual = tgt
        tgt = self.norm1(tgt)
        if cache is None:
            tgt_q, tgt_q_mask = tgt, tgt_mask
        else:
            tgt_q = tgt[:, -1:, :]
            residual = residual[:, -1:, :]
            tgt_q_mask = None if tgt_mask is None else tgt_mask[:, -1:, :]
        x = residual + self.self_attn(tgt_q, tgt, tgt, tgt_q_mask)
        residual = x
        x = self.norm2(x)
        x = residual + self.src_attn(x, memory, memory, memory_mask)
        residual = x
        x = self.norm3(x)
        x = residual + self.feed_forward(x)
        if cache is not None:
            x = torch.cat([cache, x], dim=1)
        return x, tgt_mask, memory, memory_mask


def subsequent_mask(size):
    return torch.tril(torch.ones(size, size, dtype=torch.uint8))


class Decoder(nn.Module):
    def __init__(self, odim, adim, n_head, n_layers):
        super().__init__()
        self.embed = nn.Linear(odim, adim)
        self.decoders = nn.ModuleList([DecoderLayer(adim, n_head) for _ in range(n_layers)])
        self.after_norm = nn.LayerNorm(adim)

    def forward_one_step(self, tgt, tgt_mask, memory, cache=None):
        x = self.embed(tgt)
        if cache is None:
            cache = [None] * len(self.decoders)
        new_cache = []
        for c, decoder in zip(cache, self.decoders):
            x, tgt_mask, memory, _ = decoder(x, tgt_mask, memory, None, cache=c)
            new_cache.append(x)
        y = self.after_norm(x[:, -1])
        return y, new_cache


class Transformer(nn.Module):
    def __init__(self, idim=12, odim=8, adim=16, aheads=2, elayers=1, dlayers=2, reduction_factor=1):
        super().__init__()
        self.odim = odim
        self.reduction_factor = reduction_factor
        self.encoder_embed = nn.Embedding(idim, adim)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(adim, aheads, 2 * adim, dropout=0.0, batch_first=True), elayers
        )
        self.decoder = Decoder(odim, adim, aheads, dlayers)
        self.feat_out = nn.Linear(adim, odim * reduction_factor)
        self.prob_out = nn.Linear(adim, reduction_factor)

    def inference(self, x, maxlen=6):
        xs = x.unsqueeze(0)
        hs = self.encoder(self.encoder_embed(xs))
        ys = hs.new_zeros(1, 1, self.odim)
        outs, probs = [], []
        z_cache = None
        idx = 0
        att_ws = []
        while True:
            idx += 1
            y_masks = subsequent_mask(idx).unsqueeze(0)
            z, z_cache = self.decoder.forward_one_step(ys, y_masks, hs, cache=z_cache)
            outs += [self.feat_out(z).view(self.reduction_factor, self.odim)]
            probs += [torch.sigmoid(self.prob_out(z))[0]]
            ys = torch.cat((ys, outs[-1][-1].view(1, 1, self.odim)), dim=1)
            if FIXED:
                att_ws_ = []
                for name, m in self.named_modules():
                    if isinstance(m, MultiHeadedAttention) and "src" in name:
                        att_ws_ += [m.attn]
                if idx == 1:
                    att_ws = att_ws_
                else:
                    att_ws = [torch.cat([att_w, att_w_], dim=2) for att_w, att_w_ in zip(att_ws, att_ws_)]
            if idx >= maxlen:
                break
        outs = torch.cat(outs, dim=0)
        probs = torch.cat(probs, dim=0)
        if FIXED:
            att_ws = torch.stack(att_ws, dim=0)
        else:
            # get attention weights
            att_ws = []
            for name, m in self.named_modules():
                if isinstance(m, MultiHeadedAttention) and "src" in name:
                    att_ws += [m.attn]
            att_ws = torch.cat(att_ws, dim=0)
        return outs, probs, att_ws


def main():
    model = Transformer().eval()
    text = torch.tensor([3, 5, 7, 2, 9, 4, 1])
    with torch.no_grad():
        outs, probs, att_ws = model.inference(text, maxlen=6)
    att = att_ws.reshape(-1, att_ws.shape[-2], att_ws.shape[-1])
    # alignment of the first decoder layer's first head: one row per generated frame
    alignment = att[0]
    print("outs", tuple(outs.shape), "probs", tuple(probs.shape))
    print("att_ws", tuple(att_ws.shape), "alignment", tuple(alignment.shape))
    print("argmax over text per frame:", alignment.argmax(-1).tolist())
    print("alignment sum: %.4f" % alignment.sum().item())


if __name__ == "__main__":
    main()
