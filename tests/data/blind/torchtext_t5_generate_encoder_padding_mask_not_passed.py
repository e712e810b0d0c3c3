# Citation: pytorch/text#2096 ("Include padding mask in generation"), commit db2656539
#   ("Make sure to include padding mask in generation (#2096)").
# Upstream: torchtext/prototype/generate.py GenerationUtils.generate / greedy_search, and
#   torchtext/models/t5/model.py T5Model.prepare_inputs_for_generation / forward, with
#   torchtext/models/t5/modules.py T5Encoder, T5Decoder, T5Layer, T5MultiheadAttention
#   (_t5_multi_head_attention_forward: key_padding_mask OR'ed into the (B, H, Nt, Ns) mask,
#   converted to -inf, added to the relative position bias).
# Bug: GenerationUtils.generate ran the T5 encoder as `encoder(inputs)` with no
#   src_key_padding_mask, and prepare_inputs_for_generation had no encoder_padding_mask, so the
#   decoder's cross-attention got memory_key_padding_mask=None. For a right-padded batch, the
#   encoder self-attention and the decoder cross-attention both attended to the <pad> positions,
#   so a padded prompt generated differently from the same prompt alone.
# Fix: generate builds {"src_key_padding_mask": inputs.eq(pad_idx)}, passes it to the encoder and
#   stores it as model_kwargs["encoder_padding_mask"]; prepare_inputs_for_generation forwards
#   encoder_padding_mask to T5Model.forward (memory_key_padding_mask of the decoder).
import math
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class T5Conf:
    encoder_only: bool = False
    linear_head: bool = True
    embedding_dim: int = 32
    qkv_dim: int = 8
    num_attention_heads: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    ffn_dimension: int = 64
    dropout: float = 0.0
    activation: str = "relu"
    layer_norm_eps: float = 1e-6
    relative_attention_num_buckets: int = 8
    relative_attention_max_distance: int = 16
    padding_idx: int = 0
    vocab_size: int = 40
    training: bool = False


class T5MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, is_decoder=False, dropout=0.0, qkv_dim=64,
                 compute_relative_attention_bias=False, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.is_decoder = is_decoder
        self.inner_dim = qkv_dim * num_heads
        self.q_proj_weight = nn.Parameter(torch.randn(self.inner_dim, embed_dim) * embed_dim ** -0.5)
        self.k_proj_weight = nn.Parameter(torch.randn(self.inner_dim, embed_dim) * embed_dim ** -0.5)
        self.v_proj_weight = nn.Parameter(torch.randn(self.inner_dim, embed_dim) * embed_dim ** -0.5)
        self.in_proj_bias = None
        self.out_proj = nn.Linear(self.inner_dim, embed_dim, bias=False)
        self.compute_relative_attention_bias = compute_relative_attention_bias
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        if compute_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(relative_attention_num_buckets, num_heads)
        else:
            self.relative_attention_bias = None

    def forward(self, query, key, value, query_length=None, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=False, position_bias=None, past_key_value=None):
        return self._t5_multi_head_attention_forward(
            query, key, value, query_length=query_length, position_bias=position_bias,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, past_key_value=past_key_value)

    def _t5_multi_head_attention_forward(self, query, key, value, query_length, position_bias,
                                         key_padding_mask=None, need_weights=True, attn_mask=None,
                                         average_attn_weights=False, past_key_value=None):
        is_self_attention = torch.equal(query, key)
        bsz, tgt_len, embed_dim = query.shape
        real_seq_length = tgt_len
        src_len = real_seq_length if is_self_attention else key.shape[1]
        head_dim = self.inner_dim // self.num_heads

        q = F.linear(query, self.q_proj_weight)
        if is_self_attention:
            k = F.linear(query, self.k_proj_weight)
            v = F.linear(query, self.v_proj_weight)
        else:
            k = F.linear(key, self.k_proj_weight)
            v = F.linear(value, self.v_proj_weight)

        if attn_mask is None:
            if self.is_decoder:
                if is_self_attention:
                    attn_mask = torch.triu(
                        torch.ones((tgt_len, tgt_len), dtype=torch.bool, device=query.device), diagonal=1)
                else:
                    attn_mask = torch.zeros((tgt_len, src_len), device=query.device)
            else:
                attn_mask = torch.zeros((src_len, src_len), device=query.device, dtype=torch.bool)

        if attn_mask is not None:
            if attn_mask.dim() == 2:
                x, y = attn_mask.shape
                attn_mask = attn_mask.view(1, 1, x, y).expand(bsz, self.num_heads, -1, -1)
            else:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

        q = q.view(bsz, -1, self.num_heads, head_dim).transpose(1, 2)
        k = k.view(bsz, -1, self.num_heads, head_dim).transpose(1, 2)
        v = v.view(bsz, -1, self.num_heads, head_dim).transpose(1, 2)
        src_len = k.size(2)

        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, self.num_heads, tgt_len, -1)
            if attn_mask is None:
                attn_mask = key_padding_mask
            elif attn_mask.dtype == torch.bool:
                attn_mask = attn_mask.logical_or(key_padding_mask)
            else:
                attn_mask = attn_mask.masked_fill(key_padding_mask, float("-inf"))

        if attn_mask is not None and attn_mask.dtype == torch.bool:
            tmp_attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype)
            attn_mask = tmp_attn_mask.masked_fill(attn_mask, float("-inf"))

        dropout_p = 0.0 if not self.training else self.dropout

        if position_bias is None:
            if not self.compute_relative_attention_bias:
                position_bias = torch.zeros((1, self.num_heads, real_seq_length, src_len), dtype=k.dtype)
            else:
                position_bias = self._compute_bias(real_seq_length, src_len, bidirectional=(not self.is_decoder))

        new_key_val = (k, v)
        attn_output, attn_output_weights = self._t5_dot_product_attention(q, k, v, position_bias, attn_mask, dropout_p)
        attn_output = F.linear(attn_output, self.out_proj.weight, self.out_proj.bias)
        if need_weights:
            if average_attn_weights:
                attn_output_weights = attn_output_weights.sum(dim=1) / self.num_heads
            return attn_output, position_bias, attn_output_weights, new_key_val
        return attn_output, position_bias, None, new_key_val

    def _t5_dot_product_attention(self, q, k, v, position_bias, attn_mask=None, dropout_p=0.0):
        B, H, _, E = q.shape
        attn = torch.matmul(q, k.transpose(3, 2))
        position_bias = position_bias.repeat(B, 1, 1, 1)
        if attn_mask is not None:
            position_bias += attn_mask
        attn += position_bias
        attn = F.softmax(attn, dim=-1)
        if dropout_p > 0.0:
            attn = F.dropout(attn, p=dropout_p)
        output = torch.matmul(attn, v)
        output = output.transpose(1, 2).contiguous().view(B, -1, H * E)
        return output, attn

    def _compute_bias(self, query_length, key_length, bidirectional=True):
        context_position = torch.arange(query_length, dtype=torch.long)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long)[None, :]
        relative_position = memory_position - context_position
        relative_position_bucket = self._relative_position_bucket(
            relative_position, bidirectional=bidirectional,
            num_buckets=self.relative_attention_num_buckets, max_distance=self.relative_attention_max_distance)
        values = self.relative_attention_bias(relative_position_bucket)
        values = values.permute([2, 0, 1]).unsqueeze(0)
        return values

    def _relative_position_bucket(self, relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        relative_buckets = torch.zeros(relative_position.shape, dtype=torch.long)
        if bidirectional:
            num_buckets = num_buckets // 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
        relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
        return relative_buckets


class T5LayerNorm(nn.Module):
    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class T5Layer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=3072, qkv_dim=64, dropout=0.1, activation=F.relu,
                 layer_norm_eps=1e-6, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                 compute_relative_attention_bias=False, is_decoder=False):
        super().__init__()
        self.is_decoder = is_decoder
        self.compute_relative_attention_bias = compute_relative_attention_bias
        self.self_attn = T5MultiheadAttention(
            d_model, nhead, is_decoder=is_decoder, dropout=dropout, qkv_dim=qkv_dim,
            compute_relative_attention_bias=compute_relative_attention_bias,
            relative_attention_num_buckets=relative_attention_num_buckets,
            relative_attention_max_distance=relative_attention_max_distance)
        if self.is_decoder:
            self.cross_attn = T5MultiheadAttention(
                d_model, nhead, is_decoder=True, dropout=dropout, qkv_dim=qkv_dim,
                compute_relative_attention_bias=False,
                relative_attention_num_buckets=relative_attention_num_buckets,
                relative_attention_max_distance=relative_attention_max_distance)
            self.norm3 = T5LayerNorm(d_model, eps=layer_norm_eps)
        else:
            self.cross_attn = None
            self.norm3 = None
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False)
        self.norm1 = T5LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = T5LayerNorm(d_model, eps=layer_norm_eps)
        self.activation = activation

    def forward(self, seq, memory=None, mask=None, seq_key_padding_mask=None, memory_mask=None,
                memory_key_padding_mask=None, position_bias=None, past_key_values=None):
        x = seq
        sa_out, position_bias, sa_scores, sa_kv = self._sa_block(
            self.norm1(x), mask, seq_key_padding_mask, position_bias)
        x = x + sa_out
        if self.is_decoder:
            query_length = sa_kv[0].shape[2]
            ca_out, ca_scores, ca_kv = self._ca_block(
                self.norm3(x), memory, query_length, memory_mask, memory_key_padding_mask)
            x = x + ca_out
        else:
            ca_scores, ca_kv = None, None
        x = x + self._ff_block(self.norm2(x))
        return x, position_bias, sa_scores, ca_scores, sa_kv + (ca_kv if ca_kv is not None else (None, None))

    def _sa_block(self, x, attn_mask, key_padding_mask, position_bias, past_key_value=None):
        attn, curr_position_bias, scores, curr_key_value = self.self_attn(
            x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=True,
            position_bias=position_bias, past_key_value=past_key_value)
        if self.compute_relative_attention_bias:
            position_bias = curr_position_bias
        return attn, position_bias, scores, curr_key_value

    def _ca_block(self, x, mem, query_length, attn_mask, key_padding_mask, past_key_value=None):
        attn, _, scores, curr_key_value = self.cross_attn(
            x, mem, mem, query_length=query_length, attn_mask=attn_mask,
            key_padding_mask=key_padding_mask, need_weights=True, past_key_value=past_key_value)
        return attn, scores, curr_key_value

    def _ff_block(self, x):
        return self.linear2(self.activation(self.linear1(x)))


class T5Encoder(nn.Module):
    def __init__(self, d_model, nhead, num_layers, dim_feedforward=3072, qkv_dim=64, dropout=0.1,
                 activation=F.relu, layer_norm_eps=1e-6, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, token_embeddings=None):
        super().__init__()
        self.token_embeddings = token_embeddings
        self.layers = nn.ModuleList([
            T5Layer(d_model, nhead, dim_feedforward=dim_feedforward, qkv_dim=qkv_dim, dropout=dropout,
                    activation=activation, layer_norm_eps=layer_norm_eps,
                    relative_attention_num_buckets=relative_attention_num_buckets,
                    relative_attention_max_distance=relative_attention_max_distance,
                    compute_relative_attention_bias=True if i == 0 else False, is_decoder=False)
            for i in range(num_layers)])
        self.norm = T5LayerNorm(d_model)

    def forward(self, src=None, mask=None, src_key_padding_mask=None, embedded_src=None):
        if embedded_src is None:
            embedded_src = self.token_embeddings(src)
        output = embedded_src
        position_bias = None
        all_outputs: List[Tensor] = []
        all_sa_scores = []
        for mod in self.layers:
            all_outputs.append(output)
            output, position_bias, sa_score, _, _ = mod(
                output, mask=mask, seq_key_padding_mask=src_key_padding_mask, position_bias=position_bias)
            all_sa_scores.append(sa_score)
        output = self.norm(output)
        all_outputs.append(output)
        return {"encoder_output": output, "encoder_hidden_states": all_outputs,
                "encoder_position_bias": position_bias, "encoder_sa_scores": all_sa_scores}


class T5Decoder(nn.Module):
    def __init__(self, d_model, nhead, num_layers, dim_feedforward=3072, qkv_dim=64, dropout=0.1,
                 activation=F.relu, layer_norm_eps=1e-6, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128):
        super().__init__()
        self.layers = nn.ModuleList([
            T5Layer(d_model, nhead, dim_feedforward=dim_feedforward, qkv_dim=qkv_dim, dropout=dropout,
                    activation=activation, layer_norm_eps=layer_norm_eps,
                    relative_attention_num_buckets=relative_attention_num_buckets,
                    relative_attention_max_distance=relative_attention_max_distance,
                    compute_relative_attention_bias=True if i == 0 else False, is_decoder=True)
            for i in range(num_layers)])
        self.norm = T5LayerNorm(d_model)

    def forward(self, embedded_tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, past_key_values=None, return_past_key_values=False):
        output = embedded_tgt
        position_bias = None
        all_outputs, all_sa_scores, all_ca_scores, all_key_values = [], [], [], []
        for i, mod in enumerate(self.layers):
            all_outputs.append(output)
            output, position_bias, sa_score, ca_score, past_key_value = mod(
                output, memory, mask=tgt_mask, memory_mask=memory_mask,
                seq_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask, position_bias=position_bias,
                past_key_values=past_key_values[i] if past_key_values is not None else None)
            all_sa_scores.append(sa_score)
            all_ca_scores.append(ca_score)
            if past_key_value is not None and return_past_key_values:
                all_key_values.append(past_key_value)
        output = self.norm(output)
        all_outputs.append(output)
        return {"decoder_output": output, "decoder_hidden_states": all_outputs,
                "decoder_position_bias": position_bias, "decoder_sa_scores": all_sa_scores,
                "decoder_ca_scores": all_ca_scores, "past_key_values": all_key_values}


class T5Model(nn.Module):
    def __init__(self, config: T5Conf):
        super().__init__()
        self.config = config
        self.embedding_dim = config.embedding_dim
        self.encoder_only = config.encoder_only
        self.linear_head = config.linear_head
        self.padding_idx = config.padding_idx
        self.dropout = config.dropout if config.training else 0.0
        self.token_embeddings = nn.Embedding(config.vocab_size, config.embedding_dim, config.padding_idx)
        common = dict(d_model=config.embedding_dim, nhead=config.num_attention_heads,
                      dim_feedforward=config.ffn_dimension, qkv_dim=config.qkv_dim, dropout=self.dropout,
                      activation=F.relu, layer_norm_eps=config.layer_norm_eps,
                      relative_attention_num_buckets=config.relative_attention_num_buckets,
                      relative_attention_max_distance=config.relative_attention_max_distance)
        self.encoder = T5Encoder(num_layers=config.num_encoder_layers, token_embeddings=self.token_embeddings,
                                 **common)
        self.decoder = T5Decoder(num_layers=config.num_decoder_layers, **common)
        self.lm_head = nn.Linear(config.embedding_dim, config.vocab_size, bias=False)

    if FIXED:
        def prepare_inputs_for_generation(self, input_ids, encoder_outputs, encoder_padding_mask=None,
                                          past=None, return_past_key_values=True):
            if past is not None:
                input_ids = input_ids[:, -1:]
            return {
                "decoder_tokens": input_ids,
                "encoder_outputs": encoder_outputs,
                "past_key_values": past,
                "encoder_padding_mask": encoder_padding_mask,
                "return_past_key_values": return_past_key_values,
            }
    else:
        def prepare_inputs_for_generation(self, input_ids, encoder_outputs, past=None,
                                          return_past_key_values=True):
            if past is not None:
                input_ids = input_ids[:, -1:]
            return {
                "decoder_tokens": input_ids,
                "encoder_outputs": encoder_outputs,
                "past_key_values": past,
                "return_past_key_values": return_past_key_values,
            }

    def get_encoder(self):
        return self.encoder

    def forward(self, encoder_tokens=None, decoder_tokens=None, encoder_mask=None, decoder_mask=None,
                encoder_padding_mask=None, decoder_padding_mask=None, encoder_outputs=None,
                past_key_values=None, return_past_key_values=False):
        if encoder_outputs is None:
            if encoder_padding_mask is None:
                encoder_padding_mask = encoder_tokens.eq(self.padding_idx).to(device=encoder_tokens.device)
            encoder_outputs = self.encoder(src=encoder_tokens, mask=encoder_mask,
                                           src_key_padding_mask=encoder_padding_mask)

        encoder_output = encoder_outputs.get("encoder_output")
        batch_size = encoder_output.size(0)
        if decoder_tokens is None:
            decoder_tokens = torch.ones((batch_size, 1), dtype=torch.long) * self.padding_idx
        if decoder_padding_mask is None:
            decoder_padding_mask = decoder_tokens.eq(self.padding_idx)
            # T5 implemention uses padding idx to start sequence. Want to ignore this when masking
            decoder_padding_mask[:, 0] = False

        decoder_embeddings = self.token_embeddings(decoder_tokens)
        decoder_outputs = self.decoder(
            decoder_embeddings, memory=encoder_output, tgt_mask=decoder_mask, memory_mask=encoder_mask,
            tgt_key_padding_mask=decoder_padding_mask, memory_key_padding_mask=encoder_padding_mask,
            past_key_values=past_key_values, return_past_key_values=return_past_key_values)
        decoder_output = decoder_outputs.get("decoder_output")
        if self.linear_head:
            decoder_output = decoder_output * (self.embedding_dim ** -0.5)
            decoder_output = self.lm_head(decoder_output)
            decoder_outputs["decoder_output"] = decoder_output
        out = dict(encoder_outputs)
        out.update(decoder_outputs)
        return out


DEFAULT_MAX_SEQ_LEN = 256


class GenerationUtils:
    def __init__(self, model: nn.Module, **kwargs) -> None:
        self.model = model
        self.is_encoder_decoder = kwargs.pop("is_encoder_decoder", True)
        self.is_huggingface_model = kwargs.pop("is_huggingface_model", False)

    def _prepare_decoder_ids_for_generation(self, batch_size, pad_idx=0, device=None, **model_kwargs):
        if model_kwargs is not None and "decoder_input_ids" in model_kwargs:
            return model_kwargs.pop("decoder_input_ids")
        return torch.ones((batch_size, 1), dtype=torch.long, device=device) * pad_idx

    def greedy_search(self, input_ids, max_length, eos_idx, pad_idx=None, **model_kwargs):
        if FIXED:
            unfinished_sequences = torch.ones((input_ids.shape[0]), device=input_ids.device, dtype=torch.long)
        else:
            unfinished_sequences = torch.ones((input_ids.shape[0], 1), device=input_ids.device, dtype=torch.long)

        while True:
            model_inputs = self.model.prepare_inputs_for_generation(input_ids, **model_kwargs)
            outputs = self.model(**model_inputs)
            decoder_output = outputs["decoder_output"]

            probs = F.log_softmax(decoder_output[:, -1], dim=-1)
            if FIXED:
                next_tokens = torch.argmax(probs, dim=-1)
                next_tokens = next_tokens * unfinished_sequences + pad_idx * (1 - unfinished_sequences)
                input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
                unfinished_sequences = unfinished_sequences.mul((next_tokens != eos_idx)).long()
            else:
                _, next_tokens = torch.topk(probs, 1)
                if eos_idx is not None:
                    if pad_idx is not None:
                        next_tokens = next_tokens * unfinished_sequences + pad_idx * (1 - unfinished_sequences)
                input_ids = torch.cat([input_ids, next_tokens], dim=-1)
                if eos_idx is not None:
                    unfinished_sequences = unfinished_sequences.mul((next_tokens != eos_idx).long())

            if unfinished_sequences.max() == 0 or len(input_ids[0]) >= max_length:
                break
        return input_ids

    def generate(self, inputs=None, num_beams=None, max_length=None, pad_idx=0, eos_idx=1):
        model_kwargs = {}
        if self.is_encoder_decoder:
            encoder = self.model.get_encoder()
            if FIXED:
                encoder_model_kwargs = {"src_key_padding_mask": inputs.eq(pad_idx)}
                model_kwargs["encoder_outputs"] = encoder(inputs, **encoder_model_kwargs)
                inputs = self._prepare_decoder_ids_for_generation(len(inputs), device=inputs.device, **model_kwargs)
                model_kwargs["encoder_padding_mask"] = encoder_model_kwargs.pop("src_key_padding_mask")
            else:
                model_kwargs["encoder_outputs"] = encoder(inputs)
                inputs = self._prepare_decoder_ids_for_generation(len(inputs), device=inputs.device, **model_kwargs)
        if max_length is None:
            max_length = DEFAULT_MAX_SEQ_LEN
        if num_beams == 1 or num_beams is None:
            return self.greedy_search(inputs, max_length, eos_idx, pad_idx=pad_idx, **model_kwargs)
        raise NotImplementedError()


config = T5Conf()
model = T5Model(config).eval()

# a right-padded batch of source prompts (pad_idx=0, eos_idx=1 ends each prompt)
prompts = [
    [12, 7, 33, 21, 5, 18, 9, 27, 1],
    [4, 30, 16, 1],
    [25, 11, 38, 2, 1],
]
L = max(len(p) for p in prompts)
input_ids = torch.tensor([p + [config.padding_idx] * (L - len(p)) for p in prompts])

generator = GenerationUtils(model)
with torch.no_grad():
    out = generator.generate(input_ids, num_beams=1, max_length=8, pad_idx=0, eos_idx=1)
    # score the generated continuations with a plain forward pass of the model
    scored = model(encoder_tokens=input_ids, decoder_tokens=out)
    logp = F.log_softmax(scored["decoder_output"][:, :-1], dim=-1)
    tok_logp = logp.gather(-1, out[:, 1:, None]).squeeze(-1)
    keep = out[:, 1:].ne(config.padding_idx).float()
    seq_logp = (tok_logp * keep).sum(-1)

print("generated ids:")
for row in out.tolist():
    print("  ", row)
print("sequence log-probs:", [round(v, 4) for v in seq_logp.tolist()])
