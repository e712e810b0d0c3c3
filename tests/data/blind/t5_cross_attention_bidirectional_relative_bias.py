# huggingface/transformers#8518 ("[T5] Bug correction & Refactor", fixes #8047; see #6285): the PyTorch
# port of Mesh TensorFlow's T5 (transformers v3.x modeling_t5.py) gave the decoder's cross-attention
# (EncDecAttention) its own relative position bias, bucketed bidirectionally over
# encoder_position - decoder_position, in the first decoder block, and handed it on to every later block.
# The original T5 has no position bias in encoder-decoder attention: each decoder token should reach the
# source tokens by content alone. The fix builds EncDecAttention with has_relative_attention_bias=False;
# with no weights to compute a bias, T5Attention uses a zero bias plus the encoder padding mask.
# Trimmed port of T5Attention / T5LayerSelfAttention / T5LayerCrossAttention / T5Block / T5Stack as
# transformers v3.4 wrote them (before) and v4.0 (after); source batch right-padded, greedy decoding.
import math
import sys
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers import T5Config

FIXED = "--fixed" in sys.argv


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x / torch.sqrt(variance + self.variance_epsilon)
        return self.weight * x


class T5DenseReluDense(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        return self.wo(self.dropout(F.relu(self.wi(hidden_states))))


class T5LayerFF(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.DenseReluDense = T5DenseReluDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


class T5Attention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False, is_bidirectional=False):
        super().__init__()
        self.is_bidirectional = is_bidirectional
        self.is_decoder = config.is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
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
        relative_position = memory_position - context_position  # shape (qlen, klen)
        rp_bucket = self._relative_position_bucket(
            relative_position,
            bidirectional=self.is_bidirectional,
            num_buckets=self.relative_attention_num_buckets,
        )
        values = self.relative_attention_bias(rp_bucket)  # (qlen, klen, num_heads)
        return values.permute([2, 0, 1]).unsqueeze(0)  # (1, num_heads, qlen, klen)

    def forward(self, input, mask=None, kv=None, position_bias=None):
        bs, qlen, dim = input.size()
        klen = qlen if kv is None else kv.size(1)

        def shape(x):
            return x.view(bs, -1, self.n_heads, self.d_kv).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.inner_dim)

        q = shape(self.q(input))
        src = input if kv is None else kv
        k = shape(self.k(src))
        v = shape(self.v(src))

        scores = torch.matmul(q, k.transpose(3, 2))
        if position_bias is None:
            if not self.has_relative_attention_bias:
                # v4.0: no bias weights -> a zero bias, the mask still added
                position_bias = torch.zeros((1, self.n_heads, qlen, klen), device=scores.device, dtype=scores.dtype)
            else:
                position_bias = self.compute_bias(qlen, klen)
            if mask is not None:
                position_bias = position_bias + mask  # (bs, n_heads, qlen, klen)

        scores += position_bias
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        context = self.o(unshape(torch.matmul(weights, v)))
        return context, position_bias


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.SelfAttention = T5Attention(
            config, has_relative_attention_bias=has_relative_attention_bias, is_bidirectional=not config.is_decoder
        )
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        y, position_bias = self.SelfAttention(
            self.layer_norm(hidden_states), mask=attention_mask, position_bias=position_bias
        )
        return hidden_states + self.dropout(y), position_bias


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        if FIXED:
            self.EncDecAttention = T5Attention(config, has_relative_attention_bias=False)
        else:
            self.EncDecAttention = T5Attention(
                config, has_relative_attention_bias=has_relative_attention_bias, is_bidirectional=True
            )
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, kv, attention_mask=None, position_bias=None):
        y, position_bias = self.EncDecAttention(
            self.layer_norm(hidden_states), mask=attention_mask, kv=kv, position_bias=position_bias
        )
        return hidden_states + self.dropout(y), position_bias


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
                encoder_attention_mask=None, encoder_decoder_position_bias=None):
        hidden_states, position_bias = self.layer[0](
            hidden_states, attention_mask=attention_mask, position_bias=position_bias
        )
        if self.is_decoder and encoder_hidden_states is not None:
            hidden_states, encoder_decoder_position_bias = self.layer[1](
                hidden_states,
                kv=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
                position_bias=encoder_decoder_position_bias,
            )
        hidden_states = self.layer[-1](hidden_states)
        return hidden_states, position_bias, encoder_decoder_position_bias


class T5Stack(nn.Module):
    def __init__(self, config, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.is_decoder = config.is_decoder
        self.block = nn.ModuleList(
            [T5Block(config, has_relative_attention_bias=bool(i == 0)) for i in range(config.num_layers)]
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length)
        if self.is_decoder and encoder_attention_mask is None and encoder_hidden_states is not None:
            encoder_attention_mask = torch.ones(batch_size, encoder_hidden_states.shape[1], dtype=torch.long)

        # PreTrainedModel.get_extended_attention_mask (v3.4)
        if self.is_decoder:
            seq_ids = torch.arange(seq_length)
            causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
            causal_mask = causal_mask.to(attention_mask.dtype)
            extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
        else:
            extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = (1.0 - extended_attention_mask.float()) * -10000.0

        if self.is_decoder and encoder_hidden_states is not None:
            # PreTrainedModel.invert_attention_mask (v3.4)
            encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :].float()
            encoder_extended_attention_mask = (1.0 - encoder_extended_attention_mask) * -1e9
        else:
            encoder_extended_attention_mask = None

        position_bias = None
        encoder_decoder_position_bias = None
        hidden_states = self.dropout(inputs_embeds)
        for layer_module in self.block:
            hidden_states, position_bias, encoder_decoder_position_bias = layer_module(
                hidden_states,
                attention_mask=extended_attention_mask,
                position_bias=position_bias,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_extended_attention_mask,
                encoder_decoder_position_bias=encoder_decoder_position_bias,
            )
        return self.dropout(self.final_layer_norm(hidden_states))


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model_dim = config.d_model
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        encoder_config = T5Config(**config.to_dict())
        encoder_config.is_decoder = False
        encoder_config.use_cache = False
        self.encoder = T5Stack(encoder_config, self.shared)
        decoder_config = T5Config(**config.to_dict())
        decoder_config.is_decoder = True
        decoder_config.num_layers = config.num_decoder_layers
        self.decoder = T5Stack(decoder_config, self.shared)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, decoder_input_ids, encoder_outputs=None):
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids, attention_mask=attention_mask)
        sequence_output = self.decoder(
            decoder_input_ids, encoder_hidden_states=encoder_outputs, encoder_attention_mask=attention_mask
        )
        sequence_output = sequence_output * (self.model_dim ** -0.5)
        return self.lm_head(sequence_output), encoder_outputs

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_length=6):
        decoder_input_ids = torch.full((input_ids.shape[0], 1), self.config.decoder_start_token_id, dtype=torch.long)
        encoder_outputs = None
        for _ in range(max_length):
            logits, encoder_outputs = self(input_ids, attention_mask, decoder_input_ids, encoder_outputs)
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            decoder_input_ids = torch.cat([decoder_input_ids, next_token], dim=-1)
        return decoder_input_ids


def main():
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=32, dropout_rate=0.0, layer_norm_epsilon=1e-6,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    # stand-in for a converted checkpoint: each weight drawn from its own name
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        std = 2.0 if "relative_attention_bias" in name else 0.5
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=gen) * std if "layer_norm" not in name else torch.ones(param.shape))
    model.eval()

    # right-padded source batch, as the T5 tokenizer pads
    input_ids = torch.tensor([
        [13, 27, 8, 44, 19, 31, 5, 1],
        [22, 9, 40, 1, 0, 0, 0, 0],
    ])
    attention_mask = (input_ids != config.pad_token_id).long()
    labels = torch.tensor([[7, 12, 33, 1], [50, 18, 1, 0]])
    decoder_input_ids = torch.cat(
        [torch.full((2, 1), config.decoder_start_token_id, dtype=torch.long), labels[:, :-1]], dim=-1
    )
    with torch.no_grad():
        logits, _ = model(input_ids, attention_mask, decoder_input_ids)
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), labels.reshape(-1), ignore_index=0)
    print("fixed" if FIXED else "buggy", "teacher-forced loss:", round(loss.item(), 5))
    print("greedy:", model.generate(input_ids, attention_mask).tolist())


if __name__ == "__main__":
    main()
