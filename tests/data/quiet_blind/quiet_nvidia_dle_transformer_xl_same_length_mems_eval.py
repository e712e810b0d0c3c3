"""NVIDIA DeepLearningExamples Transformer-XL (PyTorch): segment-level recurrence with relative positions.

Follows NVIDIA/DeepLearningExamples @09a17a0f3367ed0a5d87a4da12f3fb3a24cbb249,
PyTorch/LanguageModeling/Transformer-XL/pytorch/mem_transformer.py (PositionalEmbedding, PositionwiseFF,
RelMultiHeadAttn._rel_shift, RelPartialLearnableMultiHeadAttn, RelPartialLearnableDecoderLayer, AdaptiveEmbedding
with div_val=1, MemTransformerLM: init_mems as an empty (n_layer, 0) tensor, _update_mems with its mem_len ==
tgt_len fast path, _forward's dec_attn_mask = triu(ones(qlen, klen), 1 + mlen) and, with same_length, + tril(ones,
-mask_shift_len); attn_type=0), utils/proj_adaptive_softmax.py (ProjectedAdaptiveLogSoftmax, no cutoffs) and
data_utils.py (LMOrderedIterator.get_fixlen_iter / get_batch, the last segment shorter; the distributed chunking
and warmup left out). Time-major tensors [len x bsz x ...], as the project keeps them.

Training runs with same_length=False and mem_len == tgt_len; evaluation re-lengths the model (reset_length) to
mem_len > tgt_len and same_length=True, as eval.py does. Reference: each stream of the batch on its own, the whole
stream at once, layer by layer, every query t attending the keys j with max(0, segment_start(t) - mem_len) <= j <= t
(and j >= t - mem_len under same_length), relative distance t - j scored directly (no shift), in a double loop.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)  # tiny sizes: one CPU thread is fastest


def add_and_scale(tensor1, tensor2, alpha: float):
    return alpha * (tensor1 + tensor2)


class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super(PositionalEmbedding, self).__init__()
        self.demb = demb
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, pos_seq, bsz=None):
        sinusoid_inp = torch.ger(pos_seq, self.inv_freq)
        pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)
        if bsz is not None:
            return pos_emb[:, None, :].expand(-1, bsz, -1)
        else:
            return pos_emb[:, None, :]


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout, pre_lnorm=False):
        super(PositionwiseFF, self).__init__()
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner), nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(d_inner, d_model),
            nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.pre_lnorm = pre_lnorm

    def forward(self, inp):
        if self.pre_lnorm:
            core_out = self.CoreNet(self.layer_norm(inp))
            output = core_out + inp
        else:
            core_out = self.CoreNet(inp)
            output = self.layer_norm(inp + core_out)
        return output


class RelMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0,
                 tgt_len=None, ext_len=None, mem_len=None, pre_lnorm=False):
        super(RelMultiHeadAttn, self).__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_head = d_head
        self.dropout = dropout
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head ** 0.5)
        self.pre_lnorm = pre_lnorm

    def _rel_shift(self, x, zero_triu=False):
        zero_pad = torch.zeros((x.size(0), x.size(1), x.size(2), 1),
                               device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=3)
        x_padded = x_padded.view(x.size(0), x.size(1), x.size(3) + 1, x.size(2))
        x = x_padded.narrow(2, 1, x_padded.size(2) - 1).view_as(x)
        if zero_triu:
            ones = torch.ones((x.size(2), x.size(3)))
            x = x * torch.tril(ones, x.size(3) - x.size(2))[None, None, :, :]
        return x


class RelPartialLearnableMultiHeadAttn(RelMultiHeadAttn):
    def __init__(self, *args, **kwargs):
        super(RelPartialLearnableMultiHeadAttn, self).__init__(*args, **kwargs)
        self.r_net = nn.Linear(self.d_model, self.n_head * self.d_head, bias=False)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask=None, mems=None):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)

        if mems is not None:
            cat = torch.cat([mems, w], 0)
            if self.pre_lnorm:
                w_heads = self.qkv_net(self.layer_norm(cat))
            else:
                w_heads = self.qkv_net(cat)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
            w_head_q = w_head_q[-qlen:]
        else:
            if self.pre_lnorm:
                w_heads = self.qkv_net(self.layer_norm(w))
            else:
                w_heads = self.qkv_net(w)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)

        klen = w_head_k.size(0)

        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)

        rw_head_q = w_head_q + r_w_bias
        AC = torch.einsum('ibnd,jbnd->bnij', (rw_head_q, w_head_k))    # bsz x n_head x qlen x klen

        rr_head_q = w_head_q + r_r_bias
        BD = torch.einsum('ibnd,jnd->bnij', (rr_head_q, r_head_k))     # bsz x n_head x qlen x klen
        BD = self._rel_shift(BD)

        attn_score = add_and_scale(AC, BD, self.scale)

        if attn_mask is not None:
            if attn_mask.dim() == 2:
                attn_score.masked_fill_(attn_mask[None, None, :, :], -float('inf'))
            elif attn_mask.dim() == 3:
                attn_score.masked_fill_(attn_mask[:, None, :, :], -float('inf'))

        attn_prob = F.softmax(attn_score, dim=3)
        attn_prob = self.dropatt(attn_prob)

        attn_vec = torch.einsum('bnij,jbnd->ibnd', (attn_prob, w_head_v))
        attn_vec = attn_vec.contiguous().view(
            attn_vec.size(0), attn_vec.size(1), self.n_head * self.d_head)

        attn_out = self.o_net(attn_vec)
        attn_out = self.drop(attn_out)

        if self.pre_lnorm:
            output = w + attn_out
        else:
            output = self.layer_norm(w + attn_out)
        return output


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, **kwargs):
        super(RelPartialLearnableDecoderLayer, self).__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head, dropout, **kwargs)
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout, pre_lnorm=kwargs.get('pre_lnorm'))

    def forward(self, dec_inp, r, r_w_bias, r_r_bias, dec_attn_mask=None, mems=None):
        output = self.dec_attn(dec_inp, r, r_w_bias, r_r_bias,
                               attn_mask=dec_attn_mask,
                               mems=mems)
        output = self.pos_ff(output)
        return output


class AdaptiveEmbedding(nn.Module):
    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val=1):
        super(AdaptiveEmbedding, self).__init__()
        self.n_token = n_token
        self.d_embed = d_embed
        self.cutoffs = cutoffs + [n_token]
        self.div_val = div_val
        self.d_proj = d_proj
        self.emb_scale = d_proj ** 0.5
        self.cutoff_ends = [0] + self.cutoffs
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        assert div_val == 1
        self.emb_layers.append(nn.Embedding(n_token, d_embed))
        if d_proj != d_embed:
            self.emb_projs.append(nn.Parameter(torch.Tensor(d_proj, d_embed).normal_(0, 0.1)))

    def forward(self, inp):
        embed = self.emb_layers[0](inp)
        if self.d_proj != self.d_embed:
            embed = F.linear(embed, self.emb_projs[0])
        embed.mul_(self.emb_scale)
        return embed


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """The n_clusters == 0 path of utils/proj_adaptive_softmax.py (no cutoffs, div_val=1, tied weights)."""

    def __init__(self, n_token, d_embed, d_proj, out_layers_weights, out_projs):
        super().__init__()
        self.out_layers_weights = out_layers_weights
        self.out_layers_biases = nn.ParameterList([nn.Parameter(torch.zeros(n_token))])
        self.shared_out_projs = out_projs

    def _compute_logit(self, hidden, weight, bias, proj):
        if proj is None:
            logit = F.linear(hidden, weight, bias=bias)
        else:
            logit = torch.einsum('bd,de,ev->bv', (hidden, proj, weight.t()))
            if bias is not None:
                logit = logit + bias
        return logit

    def forward(self, hidden, target):
        if hidden.size(0) != target.size(0):
            raise RuntimeError('Input and target should have the same size in the batch dimension.')
        proj = self.shared_out_projs[0] if len(self.shared_out_projs) else None
        logit = self._compute_logit(hidden, self.out_layers_weights[0], self.out_layers_biases[0], proj)
        nll = -F.log_softmax(logit, dim=-1).gather(1, target.unsqueeze(1)).squeeze(1)
        return nll


class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer, n_head, d_model, d_head, d_inner,
                 dropout, dropatt, d_embed=None, pre_lnorm=False,
                 tgt_len=None, ext_len=None, mem_len=None,
                 same_length=False, clamp_len=-1):
        super(MemTransformerLM, self).__init__()
        self.n_token = n_token
        d_embed = d_model if d_embed is None else d_embed
        self.d_embed = d_embed
        self.d_model = d_model
        self.n_head = n_head
        self.d_head = d_head

        self.word_emb = AdaptiveEmbedding(n_token, d_embed, d_model, [], div_val=1)
        self.drop = nn.Dropout(dropout)
        self.n_layer = n_layer

        self.tgt_len = tgt_len
        self.mem_len = mem_len
        self.ext_len = ext_len
        self.max_klen = tgt_len + ext_len + mem_len

        self.layers = nn.ModuleList()
        for i in range(n_layer):
            self.layers.append(
                RelPartialLearnableDecoderLayer(
                    n_head, d_model, d_head, d_inner, dropout,
                    tgt_len=tgt_len, ext_len=ext_len, mem_len=mem_len,
                    dropatt=dropatt, pre_lnorm=pre_lnorm)
            )

        emb_layers = [i.weight for i in self.word_emb.emb_layers]
        self.crit = ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_model,
                                                out_layers_weights=emb_layers,
                                                out_projs=self.word_emb.emb_projs)
        self.same_length = same_length
        self.clamp_len = clamp_len

        self.pos_emb = PositionalEmbedding(self.d_model)
        self.r_w_bias = nn.Parameter(torch.Tensor(self.n_head, self.d_head).normal_(0, 0.1))
        self.r_r_bias = nn.Parameter(torch.Tensor(self.n_head, self.d_head).normal_(0, 0.1))

    def reset_length(self, tgt_len, ext_len, mem_len):
        if tgt_len < 1:
            raise RuntimeError(f'tgt_len should be >= 1, but got {tgt_len}')
        if ext_len < 0:
            raise RuntimeError(f'ext_len should be >= 0, but got {ext_len}')
        if mem_len < 0:
            raise RuntimeError(f'mem_len should be >= 0, but got {mem_len}')
        self.tgt_len = tgt_len
        self.mem_len = mem_len
        self.ext_len = ext_len

    def init_mems(self):
        if self.mem_len > 0:
            param = next(self.parameters())
            mems = torch.empty(self.n_layer, 0, dtype=param.dtype, device=param.device)
            return mems
        else:
            return None

    def _update_mems(self, hids, mems, qlen, mlen):
        if mems is None:
            return None
        assert len(hids) == len(mems), 'len(hids) != len(mems)'
        with torch.no_grad():
            stacked = torch.stack(hids)
            if (
                self.mem_len == self.tgt_len
                and self.ext_len == 0
                and stacked.size(1) == self.mem_len
            ):
                new_mems = stacked.detach()
            else:
                end_idx = mlen + max(0, qlen - self.ext_len)
                beg_idx = max(0, end_idx - self.mem_len)
                if mems.numel():
                    cat = torch.cat([mems, stacked], dim=1)
                else:
                    cat = stacked
                new_mems = cat[:, beg_idx:end_idx].detach()
        return new_mems

    def _forward(self, dec_inp, mems=None):
        qlen, bsz = dec_inp.size()

        word_emb = self.word_emb(dec_inp)

        mlen = mems[0].size(0) if mems is not None else 0
        klen = mlen + qlen
        if self.same_length:
            all_ones = word_emb.new_ones(qlen, klen)
            mask_len = klen - self.mem_len - 1
            if mask_len > 0:
                mask_shift_len = qlen - mask_len
            else:
                mask_shift_len = qlen
            dec_attn_mask = (torch.triu(all_ones, 1+mlen)
                             + torch.tril(all_ones, -mask_shift_len)).bool()
        else:
            dec_attn_mask = torch.triu(
                word_emb.new_ones(qlen, klen), diagonal=1+mlen).bool()

        hids = []
        pos_seq = torch.arange(klen-1, -1, -1.0, device=word_emb.device, dtype=word_emb.dtype)
        if self.clamp_len > 0:
            pos_seq.clamp_(max=self.clamp_len)
        pos_emb = self.pos_emb(pos_seq)

        core_out = self.drop(word_emb)
        pos_emb = self.drop(pos_emb)

        for i, layer in enumerate(self.layers):
            hids.append(core_out.detach())
            mems_i = None if mems is None else mems[i]
            core_out = layer(core_out, pos_emb, self.r_w_bias,
                             self.r_r_bias, dec_attn_mask=dec_attn_mask,
                             mems=mems_i)

        core_out = self.drop(core_out)

        new_mems = self._update_mems(hids, mems, qlen, mlen)

        return core_out, new_mems

    def forward(self, data, target, mems):
        if mems is None:
            mems = self.init_mems()

        tgt_len = target.size(0)
        hidden, new_mems = self._forward(data, mems=mems)

        pred_hid = hidden[-tgt_len:]
        loss = self.crit(pred_hid.view(-1, pred_hid.size(-1)), target.view(-1))
        loss = loss.view(tgt_len, -1)

        return (loss, new_mems)


class LMOrderedIterator(object):
    def __init__(self, data, bsz, bptt, device='cpu', ext_len=None):
        self.bsz = bsz
        self.bptt = bptt
        self.ext_len = ext_len if ext_len is not None else 0
        self.device = device
        n_step = data.size(0) // bsz
        data = data[:n_step * bsz]
        self.data = data.view(bsz, -1).t().contiguous()
        self.n_batch = (self.data.size(0) + self.bptt - 1) // self.bptt

    def get_batch(self, i, bptt=None):
        if bptt is None:
            bptt = self.bptt
        seq_len = min(bptt, self.data.size(0) - 1 - i)
        end_idx = i + seq_len
        beg_idx = max(0, i - self.ext_len)
        data = self.data[beg_idx:end_idx].to(self.device)
        target = self.data[i+1:i+1+seq_len].to(self.device)
        return data, target, seq_len

    def get_fixlen_iter(self, start=0):
        for i in range(start, self.data.size(0) - 1, self.bptt):
            yield self.get_batch(i)

    def __iter__(self):
        return self.get_fixlen_iter()


# ---------------------------------------------------------------- reference

def reference_stream_nll(model, stream, tgt_len, mem_len, same_length):
    """One stream (1-D ids) on its own: all positions at once, layer by layer, keys chosen in a double loop."""
    n = stream.size(0) - 1
    inp, tgt = stream[:n], stream[1:n + 1]
    attn_layers = [layer.dec_attn for layer in model.layers]
    H, D = model.n_head, model.d_head

    def rel_emb(dist):
        d = torch.tensor([float(dist)])
        if model.clamp_len > 0:
            d = d.clamp(max=model.clamp_len)
        return model.pos_emb(d)[0, 0]

    h = model.word_emb(inp[:, None])[:, 0]                            # n x d_model
    for layer, attn in zip(model.layers, attn_layers):
        q, k, v = torch.chunk(attn.qkv_net(h), 3, dim=-1)
        q, k, v = q.view(n, H, D), k.view(n, H, D), v.view(n, H, D)
        r_k = [attn.r_net(rel_emb(dist)).view(H, D) for dist in range(n)]   # R_{t-j}, by distance
        out = torch.zeros(n, H, D)
        for t in range(n):
            seg_start = (t // tgt_len) * tgt_len
            lo = max(0, seg_start - mem_len)
            if same_length:
                lo = max(lo, t - mem_len)
            keys = list(range(lo, t + 1))
            scores = torch.zeros(H, len(keys))
            for a, j in enumerate(keys):
                ac = ((q[t] + model.r_w_bias) * k[j]).sum(-1)
                bd = ((q[t] + model.r_r_bias) * r_k[t - j]).sum(-1)
                scores[:, a] = (ac + bd) * attn.scale
            prob = scores.softmax(-1)
            out[t] = torch.einsum('hk,khd->hd', prob, v[keys])
        attn_out = attn.o_net(out.reshape(n, H * D))
        h = attn.layer_norm(h + attn_out) if not attn.pre_lnorm else h + attn_out
        h = layer.pos_ff(h)
    return model.crit(h, tgt)


def run_segments(model, data, bsz, tgt_len):
    """eval.py / train.py's loop: mems carried from one segment to the next."""
    it = LMOrderedIterator(data, bsz, tgt_len, ext_len=model.ext_len)
    mems = None
    losses = []
    for inp, target, seq_len in it.get_fixlen_iter():
        loss, mems = model(inp, target, mems)
        losses.append(loss)
    return torch.cat(losses, 0), it        # (n_tokens_per_stream x bsz)


def check(model, data, bsz, tgt_len, mem_len, same_length):
    with torch.no_grad():
        loss, it = run_segments(model, data, bsz, tgt_len)
        for b in range(bsz):
            ref = reference_stream_nll(model, it.data[:, b], tgt_len, mem_len, same_length)
            err = (loss[:, b] - ref).abs().max().item()
            assert err < 1e-9, (b, err)
    return loss


if __name__ == '__main__':
    n_token, bsz = 50, 3
    train_tgt, train_mem = 5, 5
    model = MemTransformerLM(n_token, n_layer=2, n_head=2, d_model=16, d_head=8, d_inner=32,
                             dropout=0.0, dropatt=0.0, pre_lnorm=False,
                             tgt_len=train_tgt, ext_len=0, mem_len=train_mem,
                             same_length=False, clamp_len=-1)
    data = torch.randint(0, n_token, (bsz * 23,))

    # training: same_length=False, mem_len == tgt_len (the fast path of _update_mems)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for step in range(10):
        mems = None
        total = 0.0
        for inp, target, seq_len in LMOrderedIterator(data, bsz, train_tgt):
            loss, mems = model(inp, target, mems)
            loss = loss.float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        first = total if first is None else first
    print(f'train loss sum over segments: first epoch {first:.3f}, last {total:.3f}')
    assert total < first

    model.eval()
    check(model, data, bsz, train_tgt, train_mem, same_length=False)
    print('train-length segments (same_length=False) match the per-stream reference')

    # evaluation as eval.py: longer memory than segment, same_length attention, clamp_len
    eval_tgt, eval_mem = 4, 7
    model.reset_length(eval_tgt, 0, eval_mem)
    model.same_length = True
    model.clamp_len = 6
    loss = check(model, data, bsz, eval_tgt, eval_mem, same_length=True)
    print(f'eval (tgt_len={eval_tgt}, mem_len={eval_mem}, same_length, clamp_len=6): '
          f'ppl {loss.mean().exp().item():.3f}, matches the per-stream reference')

    model.same_length = False
    check(model, data, bsz, eval_tgt, eval_mem, same_length=False)
    print('eval without same_length matches the per-stream reference')
