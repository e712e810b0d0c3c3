# Citation: huggingface/transformers#46773 ("Fix padding mask skipped for batch size 1 in linear-attention
#   models", follow-up to huggingface/transformers#41790). PR description read; the PR was still open when read.
# Upstream: src/transformers/models/bamba/modeling_bamba.py and models/falcon_h1/modeling_falcon_h1.py,
#   apply_mask_to_padding_states() as called from the Mamba2 mixer's torch_forward (before the depthwise
#   conv and again before the SSM scan); the attention layers of the hybrid get the usual 4-D causal+padding mask.
# Bug: the helper that zeroes padding positions was gated on
#   `attention_mask.shape[1] > 1 and attention_mask.shape[0] > 1`, so a single left-padded sequence
#   (batch size 1) was never masked: the pad embeddings went through the causal conv and the SSM
#   recurrence and changed the real tokens' states and logits.
# Fix: gate on the mask being aligned with the hidden states instead
#   (`attention_mask.shape[1] == hidden_states.shape[1]`), true in prefill whatever the batch size.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def apply_mask_to_padding_states(hidden_states, attention_mask):
    """
    Tunes out the hidden states for padding tokens, see https://github.com/state-spaces/mamba/issues/66
    """
    if FIXED:
        if attention_mask is not None and attention_mask.shape[1] == hidden_states.shape[1]:
            dtype = hidden_states.dtype
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
    else:
        if attention_mask is not None and attention_mask.shape[1] > 1 and attention_mask.shape[0] > 1:
            dtype = hidden_states.dtype
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
    return hidden_states


class Config:
    vocab_size = 50
    hidden_size = 32
    num_attention_heads = 4
    mamba_n_heads = 4
    mamba_d_head = 16
    mamba_d_state = 8
    mamba_n_groups = 1
    mamba_d_conv = 4
    layers_block_type = ["mamba", "attention", "mamba"]
    rms_norm_eps = 1e-6
    pad_token_id = 0


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(v + self.eps)


class BambaMixer(nn.Module):
    """Mamba2 mixer, torch (slow) path, shrunk."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.mamba_n_heads
        self.head_dim = config.mamba_d_head
        self.ssm_state_size = config.mamba_d_state
        self.n_groups = config.mamba_n_groups
        self.intermediate_size = self.num_heads * self.head_dim
        self.conv_kernel_size = config.mamba_d_conv
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size,
            groups=self.conv_dim, padding=self.conv_kernel_size - 1, bias=True,
        )
        projection_size = self.intermediate_size + self.conv_dim + self.num_heads
        self.in_proj = nn.Linear(config.hidden_size, projection_size, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = RMSNorm(self.intermediate_size)
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def torch_forward(self, input_states, attention_mask=None):
        batch_size, seq_len, _ = input_states.shape
        dtype = input_states.dtype
        # 1. Gated MLP's linear projection
        input_states = apply_mask_to_padding_states(input_states, attention_mask)
        projected_states = self.in_proj(input_states)
        gate, hidden_states_B_C, dt = projected_states.split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        # 2. Convolution sequence transformation
        hidden_states_B_C = F.silu(self.conv1d(hidden_states_B_C.transpose(1, 2))[..., :seq_len].transpose(1, 2))
        hidden_states_B_C = apply_mask_to_padding_states(hidden_states_B_C, attention_mask)
        hidden_states, B, C = torch.split(
            hidden_states_B_C,
            [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size],
            dim=-1,
        )
        # 3. SSM transformation (sequential form of the SSD recurrence)
        A = -torch.exp(self.A_log.float())
        dt = F.softplus(dt + self.dt_bias)  # (b, l, h)
        x = hidden_states.reshape(batch_size, seq_len, self.num_heads, self.head_dim).float()
        B = B.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size).float()
        C = C.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size).float()
        B = B.repeat_interleave(self.num_heads // self.n_groups, dim=2)
        C = C.repeat_interleave(self.num_heads // self.n_groups, dim=2)
        ssm_state = torch.zeros(batch_size, self.num_heads, self.head_dim, self.ssm_state_size)
        ys = []
        for t in range(seq_len):
            dA = torch.exp(dt[:, t, :, None, None] * A[None, :, None, None])
            dBx = (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]
            ssm_state = ssm_state * dA + dBx
            y = (ssm_state * C[:, t, :, None, :]).sum(-1) + self.D[None, :, None] * x[:, t]
            ys.append(y)
        y = torch.stack(ys, dim=1).reshape(batch_size, seq_len, -1)
        scan_output = self.norm(y * F.silu(gate))
        return self.out_proj(scan_output.to(dtype))

    def forward(self, hidden_states, attention_mask=None):
        return self.torch_forward(hidden_states, attention_mask)


class BambaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        b, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(attn.transpose(1, 2).reshape(b, q_len, -1))


class BambaDecoderLayer(nn.Module):
    def __init__(self, config, layer_type):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_type == "mamba":
            self.mamba = BambaMixer(config)
        else:
            self.self_attn = BambaAttention(config)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 2 * config.hidden_size), nn.SiLU(),
            nn.Linear(2 * config.hidden_size, config.hidden_size),
        )

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "mamba":
            hidden_states = self.mamba(hidden_states, attention_mask=attention_mask)
        else:
            hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.pre_ff_layernorm(hidden_states))
        return hidden_states


class BambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        with torch.no_grad():
            # pad embedding left as a real (non-zero) row, as with pad_token_id = eos in the checkpoints
            self.embed_tokens.weight[config.pad_token_id].normal_()
        self.layers = nn.ModuleList([BambaDecoderLayer(config, t) for t in config.layers_block_type])
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _update_causal_mask(self, attention_mask, seq_len, dtype):
        causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        # padding query rows attend to themselves only, so SDPA never sees an all-masked row
        eye = torch.eye(seq_len, dtype=torch.bool)[None, None]
        mask = mask | (eye & ~attention_mask[:, None, :, None].bool())
        min_dtype = torch.finfo(dtype).min
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, min_dtype)

    def _update_mamba_mask(self, attention_mask, cache_position):
        mamba_mask = attention_mask
        if cache_position[0] > 0 or (attention_mask is not None and torch.all(attention_mask == 1)):
            mamba_mask = None
        return mamba_mask

    def forward(self, input_ids, attention_mask):
        inputs_embeds = self.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        cache_position = torch.arange(seq_len)
        causal_mask = self._update_causal_mask(attention_mask, seq_len, inputs_embeds.dtype)
        mamba_mask = self._update_mamba_mask(attention_mask, cache_position)
        hidden_states = inputs_embeds
        for layer in self.layers:
            layer_mask = mamba_mask if layer.layer_type == "mamba" else causal_mask
            hidden_states = layer(hidden_states, attention_mask=layer_mask)
        return self.final_layernorm(hidden_states)


class BambaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = BambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask):
        return self.lm_head(self.model(input_ids, attention_mask))


config = Config()
model = BambaForCausalLM(config).eval()

# One prompt, left-padded to the length the serving batch uses (batch size 1).
prompt = [7, 12, 3, 41, 9, 22]
n_pad = 5
input_ids = torch.tensor([[config.pad_token_id] * n_pad + prompt])
attention_mask = torch.tensor([[0] * n_pad + [1] * len(prompt)])

with torch.no_grad():
    logits = model(input_ids, attention_mask)
    last = logits[0, -1]
    logprobs = F.log_softmax(last, dim=-1)
    # greedy continuation of 4 tokens, recomputed without a cache
    ids, mask = input_ids, attention_mask
    generated = []
    for _ in range(4):
        nxt = model(ids, mask)[0, -1].argmax().item()
        generated.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)

print("last-token logits[:6]:", [round(v, 4) for v in last[:6].tolist()])
print("top token:", int(last.argmax()), "logprob:", round(float(logprobs.max()), 4))
print("greedy continuation:", generated)
