# huggingface/transformers#37429 ("fix document masking for chunked attention", merged 2025-04).
# make_flex_block_causal_mask (src/transformers/integrations/flex_attention.py) takes a packed 2-D
# attention mask whose values are document ids (1, 1, 1, 2, 2, 3, ..., 0 = pad). For Llama 4's chunked
# (RoPE) layers it is called with attention_chunk_size, and it overwrote document_ids with the chunk
# index of each position, so inside one chunk the causal mask_mod no longer separated documents.
# Fix: the chunk indices go in their own tensor (chunk_idxs) and a chunk_causal_mask_mod ANDs the chunk
# mask with the causal document mask. Trimmed port: a Llama 4 text model (dense MLP, no MoE) trained on
# one packed row without a cache, flex_attention and create_block_mask run eagerly on CPU.
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import Llama4TextConfig

warnings.filterwarnings("ignore")
FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def make_flex_block_causal_mask(
    attention_mask_2d,
    attention_chunk_size=None,
    query_length=None,
    key_length=None,
    offsets=None,
):
    """
    Create a block causal document mask for a batch of sequences, both packed and unpacked.

        For unpacked sequence:
        [[1, 1, 1, 1, 0, 0, 0],
         [1, 1, 1, 1, 1, 0, 0]]

        For packed sequence:
        [[1, 1, 1, 2, 2, 2, 0],
         [1, 1, 2, 2, 2, 3, 3]]
    """
    batch_size, total_seq_len = attention_mask_2d.shape
    if not key_length:
        key_length = total_seq_len
    if not query_length:
        query_length = total_seq_len
    attention_mask_2d = torch.nn.functional.pad(attention_mask_2d, value=0, pad=(0, key_length))
    device = attention_mask_2d.device
    document_ids = attention_mask_2d.clone()

    if FIXED:
        if attention_chunk_size is not None:
            # we create an arange, then we just // by chunk size to get [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
            chunk_idxs = (document_ids.clone().fill_(1).cumsum(-1) - 1) // (attention_chunk_size)
    else:
        if attention_chunk_size is not None:
            # we create an arange, then we just // by chunk size to get [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
            document_ids = (document_ids.fill_(1).cumsum(-1) - 1) // (attention_chunk_size)

    def causal_mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx  # not valid when decoding
        document_mask = document_ids[batch_idx, q_idx] == document_ids[batch_idx, kv_idx]
        padding_mask = attention_mask_2d[batch_idx, q_idx] > 0
        final_mask = causal_mask & padding_mask & document_mask
        return final_mask

    def chunk_causal_mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        """
        Combines the chunk mask with the causal mask for chunked attention.
        """
        chunk_mask = chunk_idxs[batch_idx, q_idx] == chunk_idxs[batch_idx, kv_idx]
        causal_doc_mask = causal_mask_mod(batch_idx, head_idx, q_idx, kv_idx)
        return chunk_mask & causal_doc_mask

    if FIXED:
        mask_mod_maybe_combined = causal_mask_mod if attention_chunk_size is None else chunk_causal_mask_mod
    else:
        mask_mod_maybe_combined = causal_mask_mod

    if offsets is not None:
        q_offset = offsets[0]
        kv_offset = offsets[1]

        def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
            offset_q = q_idx + q_offset
            offset_kv = kv_idx + kv_offset
            return mask_mod_maybe_combined(batch_idx, head_idx, offset_q, offset_kv)
    else:
        mask_mod = mask_mod_maybe_combined
    return create_block_mask(
        mask_mod=mask_mod,
        B=batch_size,
        H=None,  # attention head
        Q_LEN=query_length,
        KV_LEN=key_length,
        device=device,
    )


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    block_mask = None
    causal_mask = None
    if isinstance(attention_mask, BlockMask):
        block_mask = attention_mask
    else:
        causal_mask = attention_mask

    if causal_mask is not None:
        causal_mask = causal_mask[:, :, :, : key.shape[-2]]

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if causal_mask is not None:
            score = score + causal_mask[batch_idx][0][q_idx][kv_idx]
        return score

    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    attn_output = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None


class Llama4TextL2Norm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)


class Llama4TextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Llama4TextRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.head_dim
        inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        return torch.polar(torch.ones_like(freqs), freqs)  # complex freqs_cis


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Llama4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attn_scale = config.attn_scale
        self.floor_scale = config.floor_scale
        self.attn_temperature_tuning = config.attn_temperature_tuning
        self.use_rope = int(config.no_rope_layers[layer_idx])
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        if self.config.use_qk_norm and self.use_rope:
            self.qk_norm = Llama4TextL2Norm(config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache_position):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if self.use_rope:  # the 16E model skips rope for long context on certain layers
            query_states, key_states = apply_rotary_emb(query_states, key_states, position_embeddings)

        if hasattr(self, "qk_norm"):  # the 128E model does not use qk_norm
            query_states = self.qk_norm(query_states)
            key_states = self.qk_norm(key_states)

        # Use temperature tuning from https://arxiv.org/abs/2501.19399) to NoROPE layers
        if self.attn_temperature_tuning and not self.use_rope:
            attn_scales = (
                torch.log(torch.floor((cache_position.float() + 1.0) / self.floor_scale) + 1.0) * self.attn_scale + 1.0
            )
            attn_scales = attn_scales.view((1, input_shape[-1], 1, 1)).expand((*input_shape, 1, 1))
            query_states = (query_states * attn_scales).to(query_states.dtype)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)

        attn_output, attn_weights = flex_attention_forward(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class Llama4TextMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size_mlp, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size_mlp, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size_mlp, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Llama4TextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Llama4TextAttention(config, layer_idx)
        self.use_chunked_attention = int(config.no_rope_layers[layer_idx])
        self.feed_forward = Llama4TextMLP(config)
        self.input_layernorm = Llama4TextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Llama4TextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, chunk_causal_mask, position_embeddings, cache_position):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)

        # use local attention mask for ROPE layers
        if self.use_chunked_attention and chunk_causal_mask is not None:
            attention_mask = chunk_causal_mask

        attention_states = self.self_attn(hidden_states, position_embeddings, attention_mask, cache_position)
        hidden_states = residual + attention_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.feed_forward(hidden_states)
        return hidden_states


class Llama4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [Llama4TextDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Llama4TextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Llama4TextRotaryEmbedding(config)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position):
        # training path, no cache: key_length == sequence_length, offsets (0, 0)
        sequence_length = input_tensor.shape[1]
        attention_chunk_size = self.config.attention_chunk_size
        first_cache_position = cache_position[0]
        if self.config._attn_implementation == "flex_attention":
            if isinstance(attention_mask, torch.Tensor):
                offsets = (first_cache_position, 0)
                chunked_attention_mask = make_flex_block_causal_mask(
                    attention_mask, attention_chunk_size, sequence_length, sequence_length, offsets=offsets
                )
                attention_mask = make_flex_block_causal_mask(
                    attention_mask,
                    query_length=sequence_length,
                    key_length=sequence_length,
                    offsets=(first_cache_position, 0),
                )
                return attention_mask, chunked_attention_mask
        raise NotImplementedError

    def forward(self, input_ids, attention_mask, position_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
        causal_mask, chunk_causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position)
        hidden_states = inputs_embeds
        freq_cis = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, chunk_causal_mask, freq_cis, cache_position)
        return self.norm(hidden_states)


class Llama4ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Llama4TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, labels):
        logits = self.lm_head(self.model(input_ids, attention_mask, position_ids)).float()
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100)
        return loss, logits


config = Llama4TextConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    intermediate_size_mlp=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_chunk_size=8,
    no_rope_layers=[1, 1, 1, 0],
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=8,
    attn_scale=0.1,
    pad_token_id=0,
)
config._attn_implementation = "flex_attention"
model = Llama4ForCausalLM(config).eval()

# A sample-packed row the way a multipack collator hands it over: documents of 5, 7, 6 and 4 tokens,
# the attention mask numbering them 1..4, two pad slots (0) at the end; position ids restart per document.
doc_lens = [5, 7, 6, 4]
n_pad = 2
seq_len = sum(doc_lens) + n_pad
input_ids = torch.randint(1, config.vocab_size, (1, seq_len))
input_ids[0, -n_pad:] = config.pad_token_id
attention_mask = torch.cat(
    [torch.full((n,), i + 1, dtype=torch.long) for i, n in enumerate(doc_lens)] + [torch.zeros(n_pad, dtype=torch.long)]
)[None]
position_ids = torch.cat([torch.arange(n) for n in doc_lens] + [torch.arange(n_pad)])[None]
labels = input_ids.clone()
labels[attention_mask == 0] = -100
starts = torch.tensor([0] + doc_lens).cumsum(0)[:-1]
labels[0, starts[1:]] = -100  # a document's first token is not predicted from the previous document

with torch.no_grad():
    loss, logits = model(input_ids, attention_mask, position_ids, labels)

print(f"packed loss: {loss.item():.6f}")
for i, (s, n) in enumerate(zip(starts.tolist(), doc_lens)):
    print(f"doc {i + 1}: positions {s}..{s + n - 1}, next-token argmax {logits[0, s:s + n].argmax(-1).tolist()}")
