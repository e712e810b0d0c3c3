"""vLLM's ModernBERT: the local layers' sliding window handed to the encoder-only attention was one key short.

Citation: vllm-project/vllm#44040 ("[ROCm][CI] Stabilize ModernBERT token-classification parity against
Hugging Face"); code read at vllm-project/vllm 8ae7ba4 (vllm/model_executor/models/modernbert.py,
vllm/v1/attention/backends/flash_attn.py).

The bug: ``ModernBertAttention`` gave its local layers
``per_layer_sliding_window = config.local_attention // 2`` (64 for local_attention=128). The encoder-only
flash-attention backend turns a sliding window ``w`` into flash-attn's ``window_size = (w - 1, w - 1)``,
so every query of a local layer saw keys at distance <= 63 on each side, while ModernBERT (as trained,
and as Transformers runs it) lets it see keys at distance <= 64: the two keys at exactly
local_attention // 2 were dropped from every local layer.

The fix: pass ``config.local_attention // 2 + 1`` so the kernel's window covers distance <= 64, as
Transformers does (its ModernBertAttention also adds 1 for the flash path). The same PR also built RoPE
in the model dtype and took the MLP activation from the config; with a float32 model and
hidden_activation="gelu" those do not change anything here and are left as they were.

This program keeps vLLM's layout at toy sizes with random weights: a flat batch of tokens (no padding)
with ``query_start_loc`` boundaries in the forward context, ``EncoderOnlyAttention`` over
``FlashAttentionImpl`` calling ``flash_attn_varlen_func`` (a plain-torch stand-in with flash-attn's
``window_size`` semantics), alternating global / local layers and a ModernBertForTokenClassification
head. local_attention is 8 (half window 4) so that sequences of 11 and 14 tokens reach past the window.
"""

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ModernBertConfig
from transformers.activations import ACT2FN

FIXED = "--fixed" in sys.argv


# ---- vllm/attention/backends/abstract.py -----------------------------------------------------------
class AttentionType:
    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


# ---- vllm/forward_context.py ---------------------------------------------------------------------
@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    causal: bool = True


@dataclass
class ForwardContext:
    attn_metadata: Optional[FlashAttentionMetadata]


_forward_context: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None
    return _forward_context


def set_forward_context(attn_metadata):
    global _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata)


# ---- vllm_flash_attn.flash_attn_varlen_func (plain-torch stand-in) --------------------------------
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), out=None):
    # q, k, v: (total_tokens, num_heads, head_size). window_size = (left, right); -1 means unbounded.
    # Key j is visible to query i iff i - left <= j <= i + right (seqlen_q == seqlen_k here).
    left, right = window_size
    outs = []
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qi = torch.arange(qe - qs).view(-1, 1)
        kj = torch.arange(ke - ks).view(1, -1)
        allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if causal:
            allowed &= kj <= qi
        if left >= 0:
            allowed &= kj >= qi - left
        if right >= 0:
            allowed &= kj <= qi + right
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
            attn_mask=allowed, scale=softmax_scale)
        outs.append(o.transpose(0, 1))
    res = torch.cat(outs, dim=0)
    if out is not None:
        out.copy_(res)
        return out
    return res


# ---- vllm/v1/attention/backends/flash_attn.py ----------------------------------------------------
class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = alibi_slopes
        if sliding_window is None:
            self.sliding_window = (-1, -1)
        elif attn_type == AttentionType.ENCODER_ONLY:
            self.sliding_window = (sliding_window - 1, sliding_window - 1)
        else:
            self.sliding_window = (sliding_window - 1, 0)
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = 0 if logits_soft_cap is None else logits_soft_cap
        self.attn_type = attn_type

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        num_actual_tokens = attn_metadata.num_actual_tokens
        if self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
            return self._forward_encoder_attention(
                query[:num_actual_tokens], key[:num_actual_tokens], value[:num_actual_tokens],
                output[:num_actual_tokens], attn_metadata, layer)
        raise NotImplementedError("decoder path not needed for an encoder-only model")

    def _forward_encoder_attention(self, query, key, value, output, attn_metadata, layer):
        cu_seqlens_q = attn_metadata.query_start_loc
        cu_seqlens_k = attn_metadata.query_start_loc
        max_seqlen_q = attn_metadata.max_query_len
        max_seqlen_k = attn_metadata.max_query_len
        flash_attn_varlen_func(
            q=query, k=key, v=value,
            out=output,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=self.scale,
            causal=False,  # Encoder attention is bidirectional
            window_size=self.sliding_window,
        )
        return output


# ---- vllm/attention/layer.py + layers/attention/encoder_only_attention.py --------------------------
class Attention(nn.Module):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, cache_config=None, prefix="",
                 attn_type=AttentionType.DECODER, per_layer_sliding_window=None):
        super().__init__()
        if per_layer_sliding_window is not None:
            sliding_window = per_layer_sliding_window
        elif cache_config is not None:
            sliding_window = cache_config.sliding_window
        else:
            sliding_window = None
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix
        self.attn_type = attn_type
        self.impl = FlashAttentionImpl(num_heads, head_size, scale, num_kv_heads, None, sliding_window,
                                       "auto", None, attn_type)

    def forward(self, query, key, value):
        output = torch.empty_like(query).view(-1, self.num_heads, self.head_size)
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)
        attn_metadata = get_forward_context().attn_metadata
        self.impl.forward(self, query, key, value, None, attn_metadata, output=output)
        return output.view(-1, self.num_heads * self.head_size)


class EncoderOnlyAttention(Attention):
    def __init__(self, num_heads, head_size, scale, cache_config=None, attn_type=None, **kwargs):
        super().__init__(num_heads=num_heads, head_size=head_size, scale=scale, cache_config=cache_config,
                         attn_type=AttentionType.ENCODER_ONLY, **kwargs)


# ---- vllm/model_executor/layers (single-rank stand-ins) ----------------------------------------------
def get_tensor_model_parallel_world_size():
    return 1


class QKVParallelLinear(nn.Linear):
    def __init__(self, hidden_size, head_size, total_num_heads, bias=True, prefix=""):
        super().__init__(hidden_size, 3 * head_size * total_num_heads, bias=bias)

    def forward(self, x):
        return super().forward(x), None


class RowParallelLinear(nn.Linear):
    def __init__(self, input_size, output_size, bias=True, prefix=""):
        super().__init__(input_size, output_size, bias=bias)

    def forward(self, x):
        return super().forward(x), None


class RotaryEmbedding(nn.Module):
    # get_rope(...) with rope_type "default", is_neox_style=True, on flat (num_tokens, heads * head_size)
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, dtype):
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype),
                             persistent=False)

    def _rotate(self, x, cos, sin):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions, query, key):
        cos, sin = self.cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        n = positions.shape[0]
        q = self._rotate(query.view(n, -1, self.head_size), cos, sin).reshape(query.shape)
        k = self._rotate(key.view(n, -1, self.head_size), cos, sin).reshape(key.shape)
        return q, k


def get_rope(head_size, max_position, rope_parameters, dtype):
    return RotaryEmbedding(head_size, head_size, max_position, rope_parameters["rope_theta"], dtype)


# ---- vllm/model_executor/models/modernbert.py --------------------------------------------------------
class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        eps = getattr(config, "norm_eps", None) or getattr(config, "layer_norm_eps", None) or 1e-5
        self.norm = nn.LayerNorm(config.hidden_size, eps=eps, bias=config.norm_bias)

    def forward(self, input_ids, inputs_embeds=None):
        if inputs_embeds is not None:
            return self.norm(inputs_embeds)
        inputs_embeds = self.tok_embeddings(input_ids)
        return self.norm(inputs_embeds)


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModernBertConfig, layer_id: Optional[int] = None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        tp_size = get_tensor_model_parallel_world_size()
        self.layer_id = layer_id
        self.deterministic_flash_attn = config.deterministic_flash_attn
        self.num_heads = config.num_attention_heads
        assert self.num_heads % tp_size == 0
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.head_dim * self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.Wqkv = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads,
                                      bias=config.attention_bias, prefix=f"{prefix}.Wqkv")

        if layer_types := getattr(config, "layer_types", None):
            # Transformers v5
            layer_type = layer_types[layer_id]
            rope_parameters = config.rope_parameters[layer_type]
            sliding_window: Optional[int] = None
            if layer_type == "sliding_attention":
                if FIXED:
                    sliding_window = config.local_attention // 2 + 1
                else:
                    sliding_window = config.local_attention // 2
        else:
            # Transformers v4
            sliding_window = None
            if layer_id % config.global_attn_every_n_layers != 0:
                if FIXED:
                    sliding_window = config.local_attention // 2 + 1
                else:
                    sliding_window = config.local_attention // 2
                rope_theta = (config.local_rope_theta if config.local_rope_theta is not None
                              else config.global_rope_theta)
            else:
                rope_theta = config.global_rope_theta
            rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}

        self.rotary_emb = get_rope(head_size=self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=rope_parameters, dtype=torch.float32)
        self.attn = EncoderOnlyAttention(self.num_heads, self.head_dim, self.scaling,
                                         prefix=f"{layer_id}.attn", per_layer_sliding_window=sliding_window)
        self.Wo = RowParallelLinear(config.hidden_size, config.hidden_size, bias=config.attention_bias,
                                    prefix=f"{prefix}.Wo")

    def forward(self, hidden_states, position_ids):
        qkv, _ = self.Wqkv(hidden_states)
        q, k, v = qkv.split([self.all_head_size] * 3, dim=-1)
        q, k = self.rotary_emb(position_ids, q, k)
        attn_outputs = self.attn(q, k, v)
        hidden_states = attn_outputs
        hidden_states, _ = self.Wo(hidden_states)
        return hidden_states


class ModernBertMLP(nn.Module):
    def __init__(self, config: ModernBertConfig, prefix: str = ""):
        super().__init__()
        self.config = config
        self.Wi = nn.Linear(config.hidden_size, int(config.intermediate_size) * 2, bias=config.mlp_bias)
        self.act = nn.GELU()
        self.Wo = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias,
                                    prefix=f"{prefix}.Wo")

    def forward(self, hidden_states):
        input, gate = self.Wi(hidden_states).chunk(2, dim=-1)
        return self.Wo(self.act(input) * gate)[0]


class ModernBertLayer(nn.Module):
    def __init__(self, config: ModernBertConfig, prefix: str = "", layer_id: Optional[int] = None):
        super().__init__()
        self.config = config
        if layer_id == 0:
            self.attn_norm = nn.Identity()
        else:
            self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.attn = ModernBertAttention(config=config, layer_id=layer_id, prefix=f"{prefix}.attn")
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.mlp = ModernBertMLP(config, prefix=f"{prefix}.mlp")

    def forward(self, hidden_states, position_ids):
        attn_outputs = self.attn(hidden_states=self.attn_norm(hidden_states), position_ids=position_ids)
        hidden_states = hidden_states + attn_outputs
        mlp_output = self.mlp(self.mlp_norm(hidden_states))
        hidden_states = hidden_states + mlp_output
        return hidden_states


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.layers = nn.ModuleList([
            ModernBertLayer(config=config, layer_id=layer_id, prefix=f"{prefix}.layers.{layer_id}")
            for layer_id in range(config.num_hidden_layers)
        ])

    def forward(self, hidden_states, position_ids):
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, position_ids)
        return hidden_states


class ModernBertModel(nn.Module):
    def __init__(self, config, prefix: str = ""):
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.encoder_layer = ModernBertEncoderLayer(config, prefix=f"{prefix}.encoder_layer")
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if inputs_embeds is not None:
            hidden_states = inputs_embeds
        else:
            hidden_states = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)
        outputs = self.encoder_layer(hidden_states=hidden_states, position_ids=positions)
        return self.final_norm(outputs)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = ACT2FN[config.classifier_activation]
        self.norm = nn.LayerNorm(config.hidden_size, eps=getattr(config, "norm_eps", 1e-5),
                                 bias=getattr(config, "norm_bias", True))

    def forward(self, hidden_states):
        return self.norm(self.act(self.dense(hidden_states)))


class ModernBertForTokenClassification(nn.Module):
    is_pooling_model = True

    def __init__(self, config, prefix: str = "", head_dtype=torch.float32):
        super().__init__()
        self.head_dtype = head_dtype
        self.num_labels = config.num_labels
        self.model = ModernBertModel(config, prefix="modernbert")
        self.head = ModernBertPredictionHead(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=self.head_dtype)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden_states = self.model(input_ids=input_ids, positions=positions, inputs_embeds=inputs_embeds,
                                   intermediate_tensors=intermediate_tensors)
        hidden_states = self.head(hidden_states)
        hidden_states = hidden_states.to(self.head_dtype)
        return self.classifier(hidden_states)


# ---- a scheduler step: two NER requests flattened into one batch of tokens ------------------------
def build_step(prompts):
    input_ids = torch.cat([torch.tensor(p) for p in prompts])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    seq_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    query_start_loc = torch.zeros(len(prompts) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(seq_lens, 0)
    md = FlashAttentionMetadata(num_actual_tokens=int(input_ids.numel()), max_query_len=int(seq_lens.max()),
                                query_start_loc=query_start_loc, max_seq_len=int(seq_lens.max()),
                                seq_lens=seq_lens, causal=False)
    return input_ids, positions, md


def main():
    torch.manual_seed(0)
    config = ModernBertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        global_attn_every_n_layers=3, local_attention=8, max_position_embeddings=64, num_labels=5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
    )
    model = ModernBertForTokenClassification(config).eval()

    g = torch.Generator().manual_seed(1)
    prompts = [
        [1] + torch.randint(3, 64, (12,), generator=g).tolist() + [2],  # 14 tokens
        [1] + torch.randint(3, 64, (9,), generator=g).tolist() + [2],   # 11 tokens
    ]
    input_ids, positions, md = build_step(prompts)
    set_forward_context(md)
    with torch.no_grad():
        logits = model(input_ids=input_ids, positions=positions)

    # pooler_for_token_classify: per-request token logits -> softmax probabilities
    starts = md.query_start_loc.tolist()
    for r in range(len(prompts)):
        probs = logits[starts[r]:starts[r + 1]].softmax(-1)
        print(f"request {r}: labels {probs.argmax(-1).tolist()}")
        print(f"  p(label 0) {[round(x, 4) for x in probs[:, 0].tolist()]}")


if __name__ == "__main__":
    main()
