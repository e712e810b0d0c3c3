# huggingface/transformers (Jamba), PR huggingface/transformers#32914 "Fix: Jamba batched generation".
# Bug: JambaMambaMixer never received the attention mask, so left-padding tokens flowed through the causal
# conv1d and the selective-scan state into the real tokens of the hybrid (Mamba + attention) model.
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Cfg:
    vocab_size = 50
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 2
    mamba_d_state = 8
    mamba_d_conv = 4
    mamba_expand = 2
    mamba_dt_rank = 4
    rms_norm_eps = 1e-6
    layers_block_type = ["mamba", "attention", "mamba"]
    pad_token_id = 0


class JambaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


def repeat_kv(hidden_states, n_rep):
    b, h, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class JambaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : k.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class JambaMambaMixer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.ssm_state_size = config.mamba_d_state
        self.conv_kernel_size = config.mamba_d_conv
        self.intermediate_size = config.mamba_expand * config.hidden_size
        self.time_step_rank = config.mamba_dt_rank
        self.conv1d = nn.Conv1d(self.intermediate_size, self.intermediate_size, bias=True,
                                kernel_size=self.conv_kernel_size, groups=self.intermediate_size,
                                padding=self.conv_kernel_size - 1)
        self.act = nn.SiLU()
        self.in_proj = nn.Linear(self.hidden_size, self.intermediate_size * 2, bias=False)
        self.x_proj = nn.Linear(self.intermediate_size, self.time_step_rank + self.ssm_state_size * 2, bias=False)
        self.dt_proj = nn.Linear(self.time_step_rank, self.intermediate_size, bias=True)
        A = torch.arange(1, self.ssm_state_size + 1)[None, :].expand(self.intermediate_size, -1).contiguous()
        self.A_log = nn.Parameter(torch.log(A.float()))
        self.D = nn.Parameter(torch.ones(self.intermediate_size))
        self.out_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.dt_layernorm = JambaRMSNorm(self.time_step_rank, eps=config.rms_norm_eps)
        self.b_layernorm = JambaRMSNorm(self.ssm_state_size, eps=config.rms_norm_eps)
        self.c_layernorm = JambaRMSNorm(self.ssm_state_size, eps=config.rms_norm_eps)

    def slow_forward(self, input_states, cache_params=None, attention_mask=None):
        batch_size, seq_len, _ = input_states.shape
        dtype = input_states.dtype
        # 1. Gated MLP's linear projection
        projected_states = self.in_proj(input_states).transpose(1, 2)
        hidden_states, gate = projected_states.chunk(2, dim=1)

        if FIXED and attention_mask is not None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)

        # 2. Convolution sequence transformation (no cache: prefill)
        ssm_state = torch.zeros((batch_size, self.intermediate_size, self.ssm_state_size), dtype=dtype)
        hidden_states = self.act(self.conv1d(hidden_states)[..., :seq_len])

        if FIXED and attention_mask is not None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)

        # 3. State Space Model sequence transformation
        ssm_parameters = self.x_proj(hidden_states.transpose(1, 2))
        time_step, B, C = torch.split(
            ssm_parameters, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )
        time_step = self.dt_layernorm(time_step)
        B = self.b_layernorm(B)
        C = self.c_layernorm(C)
        discrete_time_step = self.dt_proj(time_step)
        discrete_time_step = nn.functional.softplus(discrete_time_step).transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        discrete_A = torch.exp(A[None, :, None, :] * discrete_time_step[:, :, :, None])
        discrete_B = discrete_time_step[:, :, :, None] * B[:, None, :, :].float()
        deltaB_u = discrete_B * hidden_states[:, :, :, None].float()
        scan_outputs = []
        for i in range(seq_len):
            ssm_state = discrete_A[:, :, i, :] * ssm_state + deltaB_u[:, :, i, :]
            scan_output = torch.matmul(ssm_state.to(dtype), C[:, i, :].unsqueeze(-1))
            scan_outputs.append(scan_output[:, :, 0])
        scan_output = torch.stack(scan_outputs, dim=-1)
        scan_output = scan_output + (hidden_states * self.D[None, :, None])
        scan_output = scan_output * self.act(gate)
        return self.out_proj(scan_output.transpose(1, 2))

    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        return self.slow_forward(hidden_states, cache_params, attention_mask)


class JambaAttentionDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = JambaAttention(config)
        self.input_layernorm = JambaRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return residual + self.self_attn(hidden_states, attention_mask=attention_mask)


class JambaMambaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mamba = JambaMambaMixer(config)
        self.input_layernorm = JambaRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if FIXED:
            hidden_states = self.mamba(hidden_states=hidden_states, attention_mask=attention_mask)
        else:
            hidden_states = self.mamba(hidden_states=hidden_states)
        return residual + hidden_states


class JambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [JambaAttentionDecoderLayer(config) if t == "attention" else JambaMambaDecoderLayer(config)
             for t in config.layers_block_type]
        )
        self.final_layernorm = JambaRMSNorm(config.hidden_size)

    def _update_causal_mask(self, attention_mask, input_tensor):
        dtype = input_tensor.dtype
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1]
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1).clone()
        mask_length = attention_mask.shape[-1]
        padding_mask = causal_mask[..., :mask_length].eq(0.0) * attention_mask[:, None, None, :].eq(0.0)
        causal_mask[..., :mask_length] = causal_mask[..., :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask):
        hidden_states = self.embed_tokens(input_ids)
        causal_mask = self._update_causal_mask(attention_mask, hidden_states)
        for layer in self.layers:
            if isinstance(layer, JambaAttentionDecoderLayer):
                layer_mask = causal_mask
            else:
                layer_mask = attention_mask
            hidden_states = layer(hidden_states, attention_mask=layer_mask)
        return self.final_layernorm(hidden_states)


cfg = Cfg()
model = JambaModel(cfg).eval()

# batched generation prompt: two prompts, tokenizer pads on the left
short = torch.tensor([5, 9, 13, 2, 7])
long_ = torch.tensor([3, 8, 11, 4, 6, 21, 17, 30, 12, 19])
L = long_.numel()
input_ids = torch.stack([torch.cat([torch.full((L - short.numel(),), cfg.pad_token_id), short]), long_])
attention_mask = torch.stack([torch.cat([torch.zeros(L - short.numel()), torch.ones(short.numel())]),
                              torch.ones(L)]).long()

with torch.no_grad():
    batched = model(input_ids, attention_mask)
    alone = model(short[None], torch.ones(1, short.numel(), dtype=torch.long))

diff = (batched[0, L - short.numel():] - alone[0]).abs().max().item()
print(f"max |left-padded batch - alone| on real tokens of short prompt: {diff:.3e}")
