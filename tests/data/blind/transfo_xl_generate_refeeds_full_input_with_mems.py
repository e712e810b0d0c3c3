# Citation: huggingface/transformers#4826 ("Fix use of mems in Transformer-XL text generation"),
#   reported in huggingface/transformers#4752. Code ported from transformers v2.x
#   src/transformers/modeling_transfo_xl.py (TransfoXLModel.forward: dec_attn_mask / init_mems / _update_mems,
#   RelPartialLearnableMultiHeadAttn, TransfoXLLMHeadModel.prepare_inputs_for_generation) and
#   modeling_utils.py (_generate_no_beam_search, _use_cache). The pre-fix prepare_inputs_for_generation is
#   recalled from the v2.11 source; the fixed one matches later releases.
# Bug: during generate(), prepare_inputs_for_generation passed the whole input_ids together with the
#   `mems` returned by the previous step. The memory already holds the hidden states of those tokens, so
#   dec_attn_mask = triu(ones(qlen, mlen + qlen), 1 + mlen) lets every re-fed token attend both to its own
#   copy in memory and to the re-fed sequence, and the relative positions of the memory are shifted by
#   the whole prompt at every step: the memory/segment recurrence sees a wrong (duplicated) context.
# Fix: when mems is given, feed only the last token (input_ids[:, -1].unsqueeze(-1)); the full input_ids
#   only on the first step.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TransfoXLConfig:
    def __init__(self, **kw):
        self.vocab_size = 40
        self.cutoffs = []
        self.d_model = 32
        self.d_embed = 32
        self.n_head = 4
        self.d_head = 8
        self.d_inner = 64
        self.div_val = 1
        self.pre_lnorm = False
        self.n_layer = 2
        self.tgt_len = 8
        self.ext_len = 0
        self.mem_len = 16
        self.clamp_len = 1000
        self.same_length = True
        self.attn_type = 0
        self.sample_softmax = -1
        self.untie_r = True
        self.dropout = 0.1
        self.dropatt = 0.0
        self.init_std = 0.3
        self.layer_norm_epsilon = 1e-5
        self.eos_token_id = 0
        self.pad_token_id = 0
        self.__dict__.update(kw)


class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super().__init__()
        self.demb = demb
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, pos_seq, bsz=None):
        sinusoid_inp = torch.outer(pos_seq, self.inv_freq)
        pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)
        if bsz is not None:
            return pos_emb[:, None, :].expand(-1, bsz, -1)
        return pos_emb[:, None, :]


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout, pre_lnorm=False, layer_norm_epsilon=1e-5):
        super().__init__()
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(d_inner, d_model), nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.pre_lnorm = pre_lnorm

    def forward(self, inp):
        if self.pre_lnorm:
            return self.CoreNet(self.layer_norm(inp)) + inp
        return self.layer_norm(inp + self.CoreNet(inp))


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0, pre_lnorm=False, layer_norm_epsilon=1e-5):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.scale = 1 / (d_head ** 0.5)
        self.pre_lnorm = pre_lnorm
        self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)

    def _rel_shift(self, x):
        zero_pad_shape = (x.size(0), 1) + x.size()[2:]
        zero_pad = torch.zeros(zero_pad_shape, device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1)
        x_padded_shape = (x.size(1) + 1, x.size(0)) + x.size()[2:]
        x_padded = x_padded.view(*x_padded_shape)
        return x_padded[1:].view_as(x)

    def forward(self, w, r, attn_mask=None, mems=None):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        if mems is not None:
            cat = torch.cat([mems, w], 0)
            w_heads = self.qkv_net(self.layer_norm(cat)) if self.pre_lnorm else self.qkv_net(cat)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
            w_head_q = w_head_q[-qlen:]
        else:
            w_heads = self.qkv_net(self.layer_norm(w)) if self.pre_lnorm else self.qkv_net(w)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)

        klen = w_head_k.size(0)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)

        rw_head_q = w_head_q + self.r_w_bias
        AC = torch.einsum("ibnd,jbnd->ijbn", (rw_head_q, w_head_k))
        rr_head_q = w_head_q + self.r_r_bias
        BD = torch.einsum("ibnd,jnd->ijbn", (rr_head_q, r_head_k))
        BD = self._rel_shift(BD)

        attn_score = AC + BD
        attn_score.mul_(self.scale)

        if attn_mask is not None and torch.sum(attn_mask).item():
            attn_mask = attn_mask == 1  # Switch to bool
            if attn_mask.dim() == 2:
                attn_score = attn_score.float().masked_fill(attn_mask[None, :, :, None], -1e30).type_as(attn_score)
            elif attn_mask.dim() == 3:
                attn_score = attn_score.float().masked_fill(attn_mask[:, :, :, None], -1e30).type_as(attn_score)

        attn_prob = F.softmax(attn_score, dim=1)
        attn_prob = self.dropatt(attn_prob)
        attn_vec = torch.einsum("ijbn,jbnd->ibnd", (attn_prob, w_head_v))
        attn_vec = attn_vec.contiguous().view(attn_vec.size(0), attn_vec.size(1), self.n_head * self.d_head)
        attn_out = self.drop(self.o_net(attn_vec))
        if self.pre_lnorm:
            return [w + attn_out]
        return [self.layer_norm(w + attn_out)]


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, layer_norm_epsilon=1e-5, **kwargs):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(
            n_head, d_model, d_head, dropout, dropatt=kwargs.get("dropatt", 0),
            pre_lnorm=kwargs.get("pre_lnorm"), layer_norm_epsilon=layer_norm_epsilon,
        )
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout, pre_lnorm=kwargs.get("pre_lnorm"),
                                     layer_norm_epsilon=layer_norm_epsilon)

    def forward(self, dec_inp, r, dec_attn_mask=None, mems=None):
        attn_outputs = self.dec_attn(dec_inp, r, attn_mask=dec_attn_mask, mems=mems)
        return [self.pos_ff(attn_outputs[0])] + attn_outputs[1:]


class AdaptiveEmbedding(nn.Module):
    # div_val == 1 and d_proj == d_embed: a single embedding table, scaled
    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val=1):
        super().__init__()
        self.d_embed, self.d_proj = d_embed, d_proj
        self.emb_scale = d_proj ** 0.5
        self.emb_layers = nn.ModuleList([nn.Embedding(n_token, d_embed)])

    def forward(self, inp):
        embed = self.emb_layers[0](inp)
        embed.mul_(self.emb_scale)
        return embed


class TransfoXLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_emb = AdaptiveEmbedding(config.vocab_size, config.d_embed, config.d_model, config.cutoffs)
        self.drop = nn.Dropout(config.dropout)
        self.n_layer = config.n_layer
        self.mem_len = config.mem_len
        self.ext_len = config.ext_len
        self.layers = nn.ModuleList([
            RelPartialLearnableDecoderLayer(
                config.n_head, config.d_model, config.d_head, config.d_inner, config.dropout,
                dropatt=config.dropatt, pre_lnorm=config.pre_lnorm, layer_norm_epsilon=config.layer_norm_epsilon,
            )
            for _ in range(config.n_layer)
        ])
        self.same_length = config.same_length
        self.clamp_len = config.clamp_len
        self.pos_emb = PositionalEmbedding(config.d_model)

    def init_mems(self, bsz):
        if self.mem_len > 0:
            param = next(self.parameters())
            return [torch.zeros(self.mem_len, bsz, self.config.d_model, dtype=param.dtype) for _ in range(self.n_layer)]
        return None

    def _update_mems(self, hids, mems, qlen, mlen):
        if mems is None:
            return None
        assert len(hids) == len(mems), "len(hids) != len(mems)"
        with torch.no_grad():
            new_mems = []
            end_idx = mlen + max(0, qlen - 0 - self.ext_len)
            beg_idx = max(0, end_idx - self.mem_len)
            for i in range(len(hids)):
                cat = torch.cat([mems[i], hids[i]], dim=0)
                new_mems.append(cat[beg_idx:end_idx].detach())
        return new_mems

    def forward(self, input_ids=None, mems=None):
        input_ids = input_ids.transpose(0, 1).contiguous()
        qlen, bsz = input_ids.size()
        if mems is None:
            mems = self.init_mems(bsz)
        word_emb = self.word_emb(input_ids)

        mlen = mems[0].size(0) if mems is not None else 0
        klen = mlen + qlen
        if self.same_length:
            all_ones = word_emb.new_ones((qlen, klen), dtype=torch.uint8)
            mask_len = klen - self.mem_len
            if mask_len > 0:
                mask_shift_len = qlen - mask_len
            else:
                mask_shift_len = qlen
            dec_attn_mask = (torch.triu(all_ones, 1 + mlen) + torch.tril(all_ones, -mask_shift_len))[:, :, None]
        else:
            dec_attn_mask = torch.triu(word_emb.new_ones((qlen, klen), dtype=torch.uint8), diagonal=1 + mlen)[
                :, :, None
            ]

        hids = []
        pos_seq = torch.arange(klen - 1, -1, -1.0, dtype=word_emb.dtype)
        if self.clamp_len > 0:
            pos_seq.clamp_(max=self.clamp_len)
        pos_emb = self.pos_emb(pos_seq)
        core_out = self.drop(word_emb)
        pos_emb = self.drop(pos_emb)
        for i, layer in enumerate(self.layers):
            hids.append(core_out)
            mems_i = None if mems is None else mems[i]
            core_out = layer(core_out, pos_emb, dec_attn_mask=dec_attn_mask, mems=mems_i)[0]
        core_out = self.drop(core_out)
        new_mems = self._update_mems(hids, mems, mlen, qlen)
        return [core_out.transpose(0, 1).contiguous(), new_mems]


class ProjectedAdaptiveLogSoftmax(nn.Module):
    # n_clusters == 0 (no cutoffs), d_proj == d_embed: a plain softmax layer
    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val=1):
        super().__init__()
        self.n_clusters = len(cutoffs)
        self.out_layers = nn.ModuleList([nn.Linear(d_embed, n_token)])

    def forward(self, hidden, labels=None):
        logit = F.linear(hidden, self.out_layers[0].weight, bias=self.out_layers[0].bias)
        return F.log_softmax(logit, dim=-1)


class TransfoXLLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = TransfoXLModel(config)
        self.crit = ProjectedAdaptiveLogSoftmax(config.vocab_size, config.d_embed, config.d_model, config.cutoffs)
        self.crit.out_layers[0].weight = self.transformer.word_emb.emb_layers[0].weight  # tie_weight

    def forward(self, input_ids=None, mems=None):
        bsz, tgt_len = input_ids.size(0), input_ids.size(1)
        transformer_outputs = self.transformer(input_ids, mems=mems)
        last_hidden = transformer_outputs[0]
        pred_hid = last_hidden[:, -tgt_len:]
        softmax_output = self.crit(pred_hid.reshape(-1, pred_hid.size(-1)), None)
        softmax_output = softmax_output.view(bsz, tgt_len, -1)
        return [softmax_output] + transformer_outputs[1:]

    def prepare_inputs_for_generation(self, input_ids, past, **model_kwargs):
        if not FIXED:
            inputs = {"input_ids": input_ids}
            # if past is defined in model kwargs then use it for faster decoding
            if past:
                inputs["mems"] = past
            return inputs
        inputs = {}
        # if past is defined in model kwargs then use it for faster decoding
        if past:
            inputs["mems"] = past
            inputs["input_ids"] = input_ids[:, -1].unsqueeze(-1)
        else:
            inputs["input_ids"] = input_ids
        return inputs

    def _use_cache(self, outputs, use_cache):
        if len(outputs) <= 1 or use_cache is False:
            return False
        if hasattr(self.config, "mem_len") and self.config.mem_len == 0:
            return False
        return True

    @torch.no_grad()
    def generate(self, input_ids, max_length, use_cache=True):
        # GenerationMixin._generate_no_beam_search, greedy (do_sample=False)
        batch_size, cur_len = input_ids.shape
        eos_token_id, pad_token_id = self.config.eos_token_id, self.config.pad_token_id
        unfinished_sents = input_ids.new(batch_size).fill_(1)
        past = None
        step_logits = []
        while cur_len < max_length:
            model_inputs = self.prepare_inputs_for_generation(input_ids, past=past, use_cache=use_cache)
            outputs = self(**model_inputs)
            next_token_logits = outputs[0][:, -1, :]
            step_logits.append(next_token_logits)
            if self._use_cache(outputs, use_cache):
                past = outputs[1]
            next_token = torch.argmax(next_token_logits, dim=-1)
            tokens_to_add = next_token * unfinished_sents + pad_token_id * (1 - unfinished_sents)
            input_ids = torch.cat([input_ids, tokens_to_add.unsqueeze(-1)], dim=-1)
            cur_len = cur_len + 1
            eos_in_sents = tokens_to_add == eos_token_id
            unfinished_sents.mul_((~eos_in_sents).long())
            if unfinished_sents.max() == 0:
                break
        return input_ids, step_logits


def main():
    config = TransfoXLConfig()
    model = TransfoXLLMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                continue
            p.normal_(0.0, config.init_std)

    # a batch of two prompts of the same length (Transformer-XL takes no attention_mask)
    prompts = torch.tensor([[5, 17, 3, 28, 11, 9], [22, 8, 31, 14, 6, 37]])
    output, step_logits = model.generate(prompts, max_length=prompts.size(1) + 8)

    print("fixed" if FIXED else "before fix")
    for row in output.tolist():
        print("generated:", row)
    print("last-step log-probs[0, :5]:", [round(x, 4) for x in step_logits[-1][0, :5].tolist()])
    print("mean max log-prob over steps: %.4f" % torch.stack([l.max(-1).values.mean() for l in step_logits]).mean())


if __name__ == "__main__":
    main()
