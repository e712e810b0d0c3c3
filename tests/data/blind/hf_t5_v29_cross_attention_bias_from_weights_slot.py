# huggingface/transformers#4499 ("[T5] Fix Cross Attention position bias").
# transformers' T5 (src/transformers/modeling_t5.py, v2.9 era), trimmed: the first block computes each
# attention's position bias (relative bias + the additive mask folded in) and T5Stack hands it on to every
# later block, which then use it in place of the mask. Each block returns
# (hidden, present_kv, [self weights], self bias, [cross weights], cross bias).
# Bug: with config.output_attentions the stack read the cross-attention bias from layer_outputs[4], which is
# the cross-attention *weights*, so the later decoder blocks' cross-attention ran over the padded source.
# Fix: read layer_outputs[5 if self.output_attentions else 3].
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import T5Config

FIXED = "--fixed" in sys.argv


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x / torch.sqrt(variance + self.variance_epsilon)
        return self.weight * x


class T5DenseReluDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        h = F.relu(self.wi(hidden_states))
        h = self.dropout(h)
        return self.wo(h)


class T5LayerFF(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.DenseReluDense = T5DenseReluDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        norm_x = self.layer_norm(hidden_states)
        y = self.DenseReluDense(norm_x)
        return hidden_states + self.dropout(y)


class T5Attention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.output_attentions = config.output_attentions
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.d_model = config.d_model
        self.d_kv = config.d_kv
        self.n_heads = config.num_heads
        self.dropout = config.dropout_rate
        self.inner_dim = self.n_heads * self.d_kv
        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if bidirectional:
            num_buckets //= 2
            ret += (n < 0).to(torch.long) * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).to(torch.long)
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        ret += torch.where(is_small, n, val_if_large)
        return ret

    def compute_bias(self, qlen, klen):
        context_position = torch.arange(qlen, dtype=torch.long)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long)[None, :]
        relative_position = memory_position - context_position
        rp_bucket = self._relative_position_bucket(
            relative_position, bidirectional=not self.is_decoder, num_buckets=self.relative_attention_num_buckets
        )
        rp_bucket = rp_bucket.to(self.relative_attention_bias.weight.device)
        values = self.relative_attention_bias(rp_bucket)  # (qlen, klen, n_heads)
        values = values.permute([2, 0, 1]).unsqueeze(0)  # (1, n_heads, qlen, klen)
        return values

    def forward(self, input, mask=None, kv=None, position_bias=None, past_key_value_state=None,
                head_mask=None, query_length=None, use_cache=False):
        bs, qlen, dim = input.size()
        real_qlen = qlen if query_length is None else query_length
        klen = real_qlen if kv is None else kv.size(1)

        def shape(x):
            return x.view(bs, -1, self.n_heads, self.d_kv).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.inner_dim)

        q = shape(self.q(input))
        if kv is None:
            k = shape(self.k(input))
            v = shape(self.v(input))
        else:
            k = shape(self.k(kv))
            v = shape(self.v(kv))

        present_key_value_state = (k, v) if (self.is_decoder and use_cache) else (None,)

        scores = torch.einsum("bnqd,bnkd->bnqk", q, k)

        if position_bias is None:
            if not self.has_relative_attention_bias:
                raise ValueError("No position_bias provided and no weights to compute position_bias")
            position_bias = self.compute_bias(real_qlen, klen)
            if mask is not None:
                position_bias = position_bias + mask  # (bs, n_heads, qlen, klen)

        scores += position_bias
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        if head_mask is not None:
            weights = weights * head_mask
        context = torch.matmul(weights, v)
        context = unshape(context)
        context = self.o(context)

        outputs = (context,) + (present_key_value_state,)
        if self.output_attentions:
            outputs = outputs + (weights,)
        if self.has_relative_attention_bias:
            outputs = outputs + (position_bias,)
        return outputs


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias=has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, head_mask=None,
                past_key_value_state=None, use_cache=False):
        norm_x = self.layer_norm(hidden_states)
        attention_output = self.SelfAttention(norm_x, mask=attention_mask, position_bias=position_bias,
                                              head_mask=head_mask, past_key_value_state=past_key_value_state,
                                              use_cache=use_cache)
        y = attention_output[0]
        layer_output = hidden_states + self.dropout(y)
        return (layer_output,) + attention_output[1:]


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, kv, attention_mask=None, position_bias=None, head_mask=None,
                past_key_value_state=None, use_cache=False, query_length=None):
        norm_x = self.layer_norm(hidden_states)
        attention_output = self.EncDecAttention(norm_x, mask=attention_mask, kv=kv, position_bias=position_bias,
                                                head_mask=head_mask, past_key_value_state=past_key_value_state,
                                                use_cache=use_cache, query_length=query_length)
        y = attention_output[0]
        layer_output = hidden_states + self.dropout(y)
        return (layer_output,) + attention_output[1:]


class T5Block(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.layer = nn.ModuleList()
        self.layer.append(T5LayerSelfAttention(config, has_relative_attention_bias=has_relative_attention_bias))
        if self.is_decoder:
            self.layer.append(T5LayerCrossAttention(config, has_relative_attention_bias=has_relative_attention_bias))
        self.layer.append(T5LayerFF(config))

    def forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None, head_mask=None,
                past_key_value_state=None, use_cache=False):
        self_attention_outputs = self.layer[0](hidden_states, attention_mask=attention_mask,
                                               position_bias=position_bias, head_mask=head_mask,
                                               past_key_value_state=None, use_cache=use_cache)
        hidden_states, present_key_value_state = self_attention_outputs[:2]
        attention_outputs = self_attention_outputs[2:]  # (self weights), (self position bias)

        if self.is_decoder and encoder_hidden_states is not None:
            query_length = hidden_states.shape[1]
            cross_attention_outputs = self.layer[1](hidden_states, kv=encoder_hidden_states,
                                                    attention_mask=encoder_attention_mask,
                                                    position_bias=encoder_decoder_position_bias,
                                                    head_mask=head_mask, past_key_value_state=None,
                                                    query_length=query_length, use_cache=use_cache)
            hidden_states = cross_attention_outputs[0]
            attention_outputs = attention_outputs + cross_attention_outputs[2:]

        hidden_states = self.layer[-1](hidden_states)
        outputs = (hidden_states,)
        # hidden-states, present_key_value_states, (self-attention weights), (self-attention position bias),
        # (cross-attention weights), (cross-attention position bias)
        outputs = outputs + (present_key_value_state,) + attention_outputs
        return outputs


class T5Stack(nn.Module):
    def __init__(self, config, embed_tokens=None):
        super().__init__()
        self.output_attentions = config.output_attentions
        self.embed_tokens = embed_tokens
        self.is_decoder = config.is_decoder
        self.block = nn.ModuleList(
            [T5Block(config, has_relative_attention_bias=bool(i == 0)) for i in range(config.num_layers)]
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length)
        if self.is_decoder and encoder_attention_mask is None and encoder_hidden_states is not None:
            encoder_attention_mask = torch.ones(batch_size, encoder_hidden_states.shape[1], dtype=torch.long)

        # get_extended_attention_mask
        if self.is_decoder:
            seq_ids = torch.arange(seq_length)
            causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
            causal_mask = causal_mask.to(attention_mask.dtype)
            extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
        else:
            extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=inputs_embeds.dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -1e9

        if self.is_decoder and encoder_attention_mask is not None:
            # invert_attention_mask
            encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :].to(inputs_embeds.dtype)
            encoder_extended_attention_mask = (1.0 - encoder_extended_attention_mask) * -1e9
        else:
            encoder_extended_attention_mask = None

        all_attentions = ()
        position_bias = None
        encoder_decoder_position_bias = None
        hidden_states = self.dropout(inputs_embeds)

        for i, layer_module in enumerate(self.block):
            layer_outputs = layer_module(hidden_states, attention_mask=extended_attention_mask,
                                         position_bias=position_bias, encoder_hidden_states=encoder_hidden_states,
                                         encoder_attention_mask=encoder_extended_attention_mask,
                                         encoder_decoder_position_bias=encoder_decoder_position_bias)
            hidden_states, present_key_value_state = layer_outputs[:2]

            if i == 0:
                # We share the position biases between the layers - the first layer store them
                # layer_outputs = hidden-states, key-value-states (self-attention weights), (self-attention position bias), (cross-attention weights), (cross-attention position bias)
                position_bias = layer_outputs[3 if self.output_attentions else 2]
                if self.is_decoder and encoder_hidden_states is not None:
                    if FIXED:
                        encoder_decoder_position_bias = layer_outputs[5 if self.output_attentions else 3]
                    else:
                        encoder_decoder_position_bias = layer_outputs[4 if self.output_attentions else 3]

            if self.output_attentions:
                all_attentions = all_attentions + (layer_outputs[2],)

        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.dropout(hidden_states)
        outputs = (hidden_states,)
        if self.output_attentions:
            outputs = outputs + (all_attentions,)
        return outputs


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model_dim = config.d_model
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        encoder_config = T5Config(**config.to_dict())
        encoder_config.is_decoder = False
        encoder_config.output_attentions = config.output_attentions
        self.encoder = T5Stack(encoder_config, self.shared)
        decoder_config = T5Config(**config.to_dict())
        decoder_config.is_decoder = True
        decoder_config.output_attentions = config.output_attentions
        self.decoder = T5Stack(decoder_config, self.shared)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.decoder_start_token_id = config.decoder_start_token_id

    def _shift_right(self, input_ids):
        shifted = input_ids.new_zeros(input_ids.shape)
        shifted[..., 1:] = input_ids[..., :-1].clone()
        shifted[..., 0] = self.decoder_start_token_id
        shifted.masked_fill_(shifted == -100, 0)
        return shifted

    def forward(self, input_ids, attention_mask=None, lm_labels=None, decoder_input_ids=None):
        encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden_states = encoder_outputs[0]
        if lm_labels is not None and decoder_input_ids is None:
            decoder_input_ids = self._shift_right(lm_labels)
        decoder_outputs = self.decoder(input_ids=decoder_input_ids, encoder_hidden_states=hidden_states,
                                       encoder_attention_mask=attention_mask)
        sequence_output = decoder_outputs[0] * (self.model_dim ** -0.5)
        lm_logits = self.lm_head(sequence_output)
        outputs = (lm_logits,) + decoder_outputs[1:]
        if lm_labels is not None:
            loss_fct = nn.CrossEntropyLoss(ignore_index=-100)
            loss = loss_fct(lm_logits.view(-1, lm_logits.size(-1)), lm_labels.view(-1))
            outputs = (loss,) + outputs
        return outputs


def main():
    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    config.output_attentions = True  # the script keeps the attention maps for inspection
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)

    # right-padded source batch (pad id 0), as the T5 tokenizer pads it
    input_ids = torch.tensor([[5, 9, 13, 22, 7, 31, 1],
                              [11, 4, 1, 0, 0, 0, 0]])
    attention_mask = (input_ids != config.pad_token_id).long()
    lm_labels = torch.tensor([[8, 17, 25, 1], [12, 3, 1, -100]])

    with torch.no_grad():
        outputs = model(input_ids, attention_mask=attention_mask, lm_labels=lm_labels)
        loss, lm_logits = outputs[0], outputs[1]

        # greedy decoding without a cache, as in the v2.9 era scripts that set output_attentions
        decoder_input_ids = torch.full((2, 1), config.decoder_start_token_id, dtype=torch.long)
        for _ in range(5):
            logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)[0]
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            decoder_input_ids = torch.cat([decoder_input_ids, next_token], dim=1)

    print("loss", round(loss.item(), 5))
    print("row 1 logits[0, :4]", [round(x, 4) for x in lm_logits[1, 0, :4].tolist()])
    print("greedy", decoder_input_ids.tolist())


if __name__ == "__main__":
    main()
