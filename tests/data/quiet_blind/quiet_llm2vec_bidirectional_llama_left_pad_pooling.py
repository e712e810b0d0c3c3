# Citation: McGill-NLP/llm2vec llm2vec/models/bidirectional_llama.py (LlamaBiModel._update_causal_mask,
#   ModifiedLlamaSdpaAttention with is_causal=False), commit 03382c358494a4e2f07222455b366fb75d625ab7, and
#   llm2vec/llm2vec.py (tokenize embed_mask, get_pooling "mean", skip_instruction), commit 020e65f8e4f2e25bd8b2f66db431809445a2733b.
# A decoder LLM turned into a bidirectional embedder: the "causal" mask is all zeros (triu commented out on purpose),
# only left-padding keys get finfo.min (additive float mask for SDPA, is_causal=False). Pooling assumes left padding
# and averages the last embed_mask.sum() positions, i.e. the text tokens only (the instruction prefix is skipped).
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Config:
    vocab_size = 100
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 128
    num_hidden_layers = 2
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    pad_token_id = 0
    _attn_implementation = "sdpa"


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None] * position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class ModifiedLlamaSdpaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.is_causal = False  # ModifiedLlamaSdpaAttention.__init__

    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : k.shape[-2]]
        attn_output = F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_mask, dropout_p=0.0,
            is_causal=self.is_causal and causal_mask is None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, -1)
        return self.o_proj(attn_output)


class ModifiedLlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = ModifiedLlamaSdpaAttention(config, layer_idx)
        self.mlp_gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.mlp_up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.mlp_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_embeddings)
        x = self.post_attention_layernorm(h)
        return h + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))


class LlamaBiModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([ModifiedLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_seen_tokens=None,
                            output_attentions=False):
        dtype, device = input_tensor.dtype, input_tensor.device
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1] if isinstance(attention_mask, torch.Tensor) \
            else past_seen_tokens + sequence_length + 1

        causal_mask = torch.zeros((sequence_length, target_length), dtype=dtype, device=device)
        # Commenting out next 2 lines to disable causal masking
        # if sequence_length != 1:
        #     causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            if attention_mask.dim() == 2:
                mask_length = attention_mask.shape[-1]
                padding_mask = causal_mask[..., :mask_length].eq(0.0) * attention_mask[:, None, None, :].eq(0.0)
                causal_mask[..., :mask_length] = causal_mask[..., :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask):
        inputs_embeds = self.embed_tokens(input_ids)
        past_seen_tokens = 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1])
        position_ids = cache_position.unsqueeze(0)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, past_seen_tokens)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, position_embeddings)
        return self.norm(hidden_states)


def get_pooling(features, last_hidden_states, skip_instruction=True):  # All models padded from left
    if skip_instruction:
        features["attention_mask"] = features["embed_mask"]
    seq_lengths = features["attention_mask"].sum(dim=-1)
    return torch.stack([last_hidden_states[i, -length:, :].mean(dim=0) for i, length in enumerate(seq_lengths)], dim=0)


def tokenize_left(batch, instr_len):
    # tokenizer.padding_side == "left": instruction ids + text ids, right-aligned; embed_mask marks the text part
    L = max(len(x) for x in batch)
    input_ids = torch.zeros(len(batch), L, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), L, dtype=torch.long)
    embed_mask = torch.zeros(len(batch), L, dtype=torch.long)
    for i, ids in enumerate(batch):
        input_ids[i, L - len(ids):] = torch.tensor(ids)
        attention_mask[i, L - len(ids):] = 1
        embed_mask[i, L - (len(ids) - instr_len[i]):] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "embed_mask": embed_mask}


config = Config()
model = LlamaBiModel(config).eval()
queries = [list(torch.randint(1, 100, (n,)).tolist()) for n in (12, 7, 4)]
docs = [list(torch.randint(1, 100, (n,)).tolist()) for n in (5, 11, 9)]
q_feat = tokenize_left(queries, instr_len=[3, 3, 3])
d_feat = tokenize_left(docs, instr_len=[0, 0, 0])
with torch.no_grad():
    q_emb = get_pooling(q_feat, model(q_feat["input_ids"], q_feat["attention_mask"]))
    d_emb = get_pooling(d_feat, model(d_feat["input_ids"], d_feat["attention_mask"]))
sim = F.normalize(q_emb, dim=-1) @ F.normalize(d_emb, dim=-1).T
print("cos sim diag:", [round(v, 4) for v in sim.diag().tolist()])
