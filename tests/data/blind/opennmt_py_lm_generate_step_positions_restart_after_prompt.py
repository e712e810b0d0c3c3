"""OpenNMT/OpenNMT-py#2099 (commit c8081afa, "fix pos encoding error + target prefixing error in LM decoding").

GeneratorLM._translate_batch_with_strategy feeds the whole prompt (src) to the TransformerLMDecoder at step 0, then
one predicted token a step with the layer caches. The decoder's Embeddings add PositionalEncoding pe[step:step+len],
and before the fix the loop passed `step=step`: after a prompt of L tokens the generated tokens were numbered from
position 1 again, on top of the prompt's own positions, while their keys sit after the prompt in the cache. The
split of the prompt also kept its last token as a forced target prefix (src[min_len - 1:]).
The fix passes `step + src_lengths[0]` after step 0 and splits the prefix at min_len (src[min_len:]).
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PositionalEncoding(nn.Module):
    def __init__(self, dim, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, dim)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp((torch.arange(0, dim, 2, dtype=torch.float) * -(math.log(10000.0) / dim)))
        pe[:, 0::2] = torch.sin(position.float() * div_term)
        pe[:, 1::2] = torch.cos(position.float() * div_term)
        pe = pe.unsqueeze(1)
        self.register_buffer("pe", pe)
        self.dim = dim

    def forward(self, emb, step=None):
        emb = emb * math.sqrt(self.dim)
        step = step or 0
        emb = emb + self.pe[step:emb.size(0) + step]
        return emb


class Embeddings(nn.Module):
    def __init__(self, word_vec_size, word_vocab_size, word_padding_idx):
        super().__init__()
        self.word_padding_idx = word_padding_idx
        self.word_lut = nn.Embedding(word_vocab_size, word_vec_size, padding_idx=word_padding_idx)
        self.pe = PositionalEncoding(word_vec_size)

    def forward(self, source, step=None):
        # source: (len, batch, nfeat)
        emb = self.word_lut(source[:, :, 0])
        return self.pe(emb, step=step)


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim):
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, model_dim)
        self.linear_values = nn.Linear(model_dim, model_dim)
        self.linear_query = nn.Linear(model_dim, model_dim)
        self.softmax = nn.Softmax(dim=-1)
        self.final_linear = nn.Linear(model_dim, model_dim)

    def forward(self, key, value, query, mask=None, layer_cache=None, attn_type=None):
        batch_size = key.size(0)
        dim_per_head = self.dim_per_head
        head_count = self.head_count

        def shape(x):
            return x.view(batch_size, -1, head_count, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(batch_size, -1, head_count * dim_per_head)

        if layer_cache is not None:
            if attn_type == "self":
                query, key, value = self.linear_query(query), self.linear_keys(query), self.linear_values(query)
                key = shape(key)
                value = shape(value)
                if layer_cache["self_keys"] is not None:
                    key = torch.cat((layer_cache["self_keys"], key), dim=2)
                if layer_cache["self_values"] is not None:
                    value = torch.cat((layer_cache["self_values"], value), dim=2)
                layer_cache["self_keys"] = key
                layer_cache["self_values"] = value
        else:
            key = shape(self.linear_keys(key))
            value = shape(self.linear_values(value))
            query = self.linear_query(query)

        query = shape(query)
        query = query / math.sqrt(dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3)).float()

        if mask is not None:
            mask = mask.unsqueeze(1)  # [B, 1, 1, T_values]
            scores = scores.masked_fill(mask, -1e18)

        attn = self.softmax(scores).to(query.dtype)
        context = unshape(torch.matmul(attn, value))
        output = self.final_linear(context)
        return output, attn.view(batch_size, head_count, attn.size(2), attn.size(3))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, x):
        inter = torch.relu(self.w_1(self.layer_norm(x)))
        return self.w_2(inter) + x


class TransformerLMDecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff)
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)

    def _compute_dec_mask(self, tgt_pad_mask, future):
        tgt_len = tgt_pad_mask.size(-1)
        if not future:
            future_mask = torch.ones([tgt_len, tgt_len], device=tgt_pad_mask.device, dtype=torch.uint8)
            future_mask = future_mask.triu_(1).view(1, tgt_len, tgt_len).bool()
            dec_mask = torch.gt(tgt_pad_mask + future_mask, 0)
        else:
            dec_mask = tgt_pad_mask
        return dec_mask

    def forward(self, inputs, tgt_pad_mask, layer_cache=None, step=None, future=False):
        dec_mask = None
        if inputs.size(1) > 1:
            # masking is necessary when sequence length is greater than one
            dec_mask = self._compute_dec_mask(tgt_pad_mask, future)
        inputs_norm = self.layer_norm_1(inputs)
        query, attns = self.self_attn(inputs_norm, inputs_norm, inputs_norm, mask=dec_mask,
                                      layer_cache=layer_cache, attn_type="self")
        output = query + inputs
        output_feedforward = self.feed_forward(output)
        return output_feedforward, attns


class TransformerLMDecoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.state = {}
        self.transformer_layers = nn.ModuleList(
            [TransformerLMDecoderLayer(d_model, heads, d_ff) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def init_state(self, src=None, memory_bank=None, enc_hidden=None):
        self.state["cache"] = None

    def _init_cache(self, memory_bank=None):
        self.state["cache"] = {}
        for i, layer in enumerate(self.transformer_layers):
            self.state["cache"]["layer_{}".format(i)] = {"self_keys": None, "self_values": None}

    def forward(self, tgt, memory_bank=None, step=None, **kwargs):
        """Decode, possibly stepwise."""
        if step == 0:
            self._init_cache()
        tgt_words = tgt[:, :, 0].transpose(0, 1)
        emb = self.embeddings(tgt, step=step)
        output = emb.transpose(0, 1).contiguous()
        pad_idx = self.embeddings.word_padding_idx
        tgt_pad_mask = tgt_words.data.eq(pad_idx).unsqueeze(1)  # [B, 1, T_tgt]
        for i, layer in enumerate(self.transformer_layers):
            layer_cache = self.state["cache"]["layer_{}".format(i)] if step is not None else None
            output, attn = layer(output, tgt_pad_mask, layer_cache=layer_cache, step=step)
        output = self.layer_norm(output)
        dec_outs = output.transpose(0, 1).contiguous()
        return dec_outs, {"std": attn}


class GreedySearchLM:
    """Greedy decoding (sampling_temp 0, beam 1) with target-prefix forcing, as DecodeStrategy does it."""

    def __init__(self, pad, bos, eos, max_length):
        self.pad, self.bos, self.eos, self.max_length = pad, bos, eos, max_length

    def initialize(self, src, src_lengths, target_prefix=None):
        batch_size = src.size(1)
        self.alive_seq = torch.full([1, batch_size], self.bos, dtype=torch.long)
        self.target_prefix = target_prefix
        self.scores = torch.zeros(batch_size)
        return None, src, src_lengths.clone()

    def maybe_update_target_prefix(self, log_probs):
        step = self.alive_seq.size(0) - 1
        if self.target_prefix is None or step >= self.target_prefix.size(0):
            return log_probs
        forced = self.target_prefix[step, :, 0]
        keep = forced.ne(self.pad)
        pick = torch.full_like(log_probs, -10000.0)
        pick.scatter_(1, forced.unsqueeze(1), 0.0)
        return torch.where(keep.unsqueeze(1), pick, log_probs)

    def advance(self, log_probs):
        log_probs = self.maybe_update_target_prefix(log_probs)
        topk_scores, topk_ids = log_probs.max(dim=-1)
        self.scores += topk_scores
        self.alive_seq = torch.cat([self.alive_seq, topk_ids.view(1, -1)], 0)

    @property
    def current_predictions(self):
        return self.alive_seq[-1]


class GeneratorLM:
    def __init__(self, model, generator):
        self.model = model
        self.generator = generator

    @classmethod
    def split_src_to_prevent_padding(cls, src, src_lengths):
        min_len_batch = torch.min(src_lengths).item()
        target_prefix = None
        if FIXED:
            if min_len_batch > 0 and min_len_batch < src.size(0):
                target_prefix = src[min_len_batch:]
                src = src[:min_len_batch]
                src_lengths[:] = min_len_batch
        else:
            if min_len_batch > 0 and min_len_batch <= src.size(0):
                # hack [min_len_batch-1:] because expect <bos>
                target_prefix = (
                    src[min_len_batch - 1:]
                    if min_len_batch > 0 and min_len_batch <= src.size(0)
                    else None
                )
                src = src[:min_len_batch]
                src_lengths[:] = min_len_batch
        return src, src_lengths, target_prefix

    def _decode_and_generate(self, decoder_input, step):
        dec_out, dec_attn = self.model(decoder_input, None, step=step)
        log_probs = self.generator(dec_out.squeeze(0))
        return log_probs, dec_attn["std"]

    def translate_batch(self, src, src_lengths, decode_strategy):
        src, src_lengths, target_prefix = self.split_src_to_prevent_padding(src, src_lengths)
        self.model.init_state(src, None, None)
        fn_map_state, src, memory_lengths = decode_strategy.initialize(src, src_lengths, target_prefix=target_prefix)
        for step in range(decode_strategy.max_length):
            decoder_input = src if step == 0 else decode_strategy.current_predictions.view(1, -1, 1)
            log_probs, attn = self._decode_and_generate(
                decoder_input,
                step=(step if step == 0 else step + src_lengths[0].item()) if FIXED else step,
            )
            if step == 0:
                log_probs = log_probs[-1]
            decode_strategy.advance(log_probs)
        return decode_strategy.alive_seq[1:].t(), decode_strategy.scores


vocab, d_model, pad, bos, eos = 48, 32, 1, 2, 3
embeddings = Embeddings(d_model, vocab, pad)
decoder = TransformerLMDecoder(num_layers=2, d_model=d_model, heads=4, d_ff=64, embeddings=embeddings).eval()
generator = nn.Sequential(nn.Linear(d_model, vocab), nn.LogSoftmax(dim=-1)).eval()
# prompts as the LM inputter gives them: (src_len, batch, 1), every line 7 tokens
prompts = torch.tensor([[2, 11, 17, 23, 8, 30, 14], [2, 40, 6, 19, 27, 12, 35]])
src = prompts.t().unsqueeze(-1)
src_lengths = torch.tensor([7, 7])

translator = GeneratorLM(decoder, generator)
with torch.no_grad():
    hyps, scores = translator.translate_batch(src, src_lengths, GreedySearchLM(pad, bos, eos, max_length=8))
for i in range(hyps.size(0)):
    print("prompt", prompts[i].tolist(), "->", hyps[i].tolist(), "score %.4f" % scores[i].item())
