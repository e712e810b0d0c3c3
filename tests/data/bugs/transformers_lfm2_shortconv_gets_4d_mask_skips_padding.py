# huggingface/transformers (LFM2 hybrid conv/attention), PR huggingface/transformers#41790 "Fix attention mask in mamba layers".
# Bug: Lfm2Model handed the 4D causal mask to the ShortConv layers, and apply_mask_to_padding_states only applies a mask
# with shape[1] > 1, so the (B, 1, q, k) mask was silently skipped and left-padding leaked through the causal conv.
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Lfm2Config:
    vocab_size = 40
    hidden_size = 32
    intermediate_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    conv_L_cache = 3
    conv_bias = False
    norm_eps = 1e-5
    layer_types = ["conv", "conv", "full_attention", "conv"]
    pad_token_id = 0


class Lfm2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class Lfm2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def repeat_kv(hidden_states, n_rep):
    b, h, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights.masked_fill(~causal_mask, torch.finfo(attn_weights.dtype).min)
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()


class Lfm2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_layernorm = Lfm2RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_layernorm = Lfm2RMSNorm(self.head_dim, eps=config.norm_eps)

    def forward(self, hidden_states, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_layernorm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_layernorm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        out = eager_attention_forward(self, q, k, v, attention_mask, self.scaling)
        return self.out_proj(out.reshape(*input_shape, -1))


def apply_mask_to_padding_states(hidden_states, attention_mask):
    """
    Tunes out the hidden states for padding tokens, see https://github.com/state-spaces/mamba/issues/66
    """
    if attention_mask is not None and attention_mask.shape[1] > 1 and attention_mask.shape[0] > 1:
        dtype = hidden_states.dtype
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
    return hidden_states


class Lfm2ShortConv(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.L_cache = config.conv_L_cache
        self.conv = nn.Conv1d(config.hidden_size, config.hidden_size, kernel_size=self.L_cache,
                              groups=config.hidden_size, bias=config.conv_bias, padding=self.L_cache - 1)
        self.in_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.conv_bias)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.conv_bias)

    def slow_forward(self, x, past_key_values=None, cache_position=None, attention_mask=None):
        seqlen = x.shape[1]
        x = apply_mask_to_padding_states(x, attention_mask)
        BCx = self.in_proj(x).transpose(-1, -2)
        B, C, x = BCx.chunk(3, dim=-2)
        Bx = B * x
        conv_out = self.conv(Bx)[..., :seqlen]
        y = C * conv_out
        y = y.transpose(-1, -2).contiguous()
        return self.out_proj(y)

    def forward(self, hidden_states, past_key_values=None, cache_position=None, attention_mask=None):
        return self.slow_forward(hidden_states, past_key_values, cache_position, attention_mask)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.is_attention_layer = config.layer_types[layer_idx] == "full_attention"
        if self.is_attention_layer:
            self.self_attn = Lfm2Attention(config)
        else:
            self.conv = Lfm2ShortConv(config)
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        h = self.operator_norm(hidden_states)
        if self.is_attention_layer:
            h = self.self_attn(h, attention_mask=attention_mask)
        else:
            h = self.conv(h, attention_mask=attention_mask)
        h = h + hidden_states
        return h + self.feed_forward(self.ffn_norm(h))


def create_causal_mask(attention_mask, input_embeds):
    # masking_utils.create_causal_mask (eager/sdpa path): boolean (B, 1, q, kv), True = attend
    q_len = input_embeds.shape[1]
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    return causal[None, None] & attention_mask[:, None, None, :].bool()


class Lfm2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Lfm2DecoderLayer(config, i) for i in range(len(config.layer_types))])
        self.embedding_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids, attention_mask):
        inputs_embeds = self.embed_tokens(input_ids)
        causal_mask = create_causal_mask(attention_mask, inputs_embeds)
        if FIXED:
            # fix: conv layers get the plain 2D padding mask, attention layers the causal mask
            conv_mask = attention_mask
            mask_mapping = {"full_attention": causal_mask, "conv": conv_mask}
        else:
            mask_mapping = {"full_attention": causal_mask, "conv": causal_mask}
        hidden_states = inputs_embeds
        for i, decoder_layer in enumerate(self.layers):
            hidden_states = decoder_layer(hidden_states, attention_mask=mask_mapping[self.config.layer_types[i]])
        return self.embedding_norm(hidden_states)


config = Lfm2Config()
model = Lfm2Model(config).eval()
# the padding token embedding is not zero in trained checkpoints (pad = eos)
with torch.no_grad():
    model.embed_tokens.weight[config.pad_token_id].normal_()

short = torch.tensor([4, 7, 12, 9])
long_ = torch.tensor([3, 15, 8, 22, 6, 31, 10, 5, 18])
n_pad = long_.numel() - short.numel()
input_ids = torch.stack([torch.cat([torch.full((n_pad,), config.pad_token_id), short]), long_])
attention_mask = (input_ids != config.pad_token_id).long()
attention_mask[1] = 1

with torch.no_grad():
    batched = model(input_ids, attention_mask)
    alone = model(short[None], torch.ones(1, short.numel(), dtype=torch.long))
diff = (batched[0, n_pad:] - alone[0]).abs().max().item()
print(f"max |left-padded batch - alone| on real tokens of short prompt: {diff:.3e}")
