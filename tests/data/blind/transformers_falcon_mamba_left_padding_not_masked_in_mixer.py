# Citation: huggingface/transformers#32677 ("Mamba / FalconMamba: Fix mamba left padding"),
#   follow-up of the review remark in huggingface/transformers#32080.
# Upstream: src/transformers/models/falcon_mamba/modeling_falcon_mamba.py (and mamba/modeling_mamba.py):
#   FalconMambaMixer.slow_forward / FalconMambaBlock.forward / FalconMambaModel.forward /
#   FalconMambaForCausalLM.prepare_inputs_for_generation (transformers 4.44 era, ported to plain torch).
# Bug: the model accepted `attention_mask` but never handed it to the mixers, so with a left-padded
#   batch the pad tokens ran through the causal conv1d and the selective scan and left their trace in
#   the conv and SSM states that the real tokens of the shorter prompt read.
# Fix: pass `attention_mask` down to every block and, in the mixer, zero the pad positions of the
#   hidden states before and after the causal conv1d (`hidden_states * attention_mask.unsqueeze(1)`);
#   at cached decode steps the mask is dropped (`attention_mask = None`) since only one token is fed.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class FalconMambaConfig:
    def __init__(self, vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=2,
                 layer_norm_epsilon=1e-5, pad_token_id=0, expand=2, conv_kernel=4,
                 use_bias=False, use_conv_bias=True, hidden_act="silu", residual_in_fp32=True,
                 time_step_rank="auto", mixer_rms_eps=1e-6):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.state_size = state_size
        self.num_hidden_layers = num_hidden_layers
        self.layer_norm_epsilon = layer_norm_epsilon
        self.pad_token_id = pad_token_id
        self.expand = expand
        self.conv_kernel = conv_kernel
        self.intermediate_size = int(expand * hidden_size)
        self.use_bias = use_bias
        self.use_conv_bias = use_conv_bias
        self.hidden_act = hidden_act
        self.residual_in_fp32 = residual_in_fp32
        self.time_step_rank = math.ceil(hidden_size / 16) if time_step_rank == "auto" else time_step_rank
        self.mixer_rms_eps = mixer_rms_eps


class FalconMambaCache:
    def __init__(self, config, batch_size, dtype=torch.float32, device=None):
        self.dtype = dtype
        self.conv_kernel_size = config.conv_kernel
        self.conv_states = torch.zeros(config.num_hidden_layers, batch_size, config.intermediate_size,
                                       self.conv_kernel_size, device=device, dtype=dtype)
        self.ssm_states = torch.zeros(config.num_hidden_layers, batch_size, config.intermediate_size,
                                      config.state_size, device=device, dtype=dtype)

    def update_conv_state(self, layer_idx, new_conv_state, cache_position):
        conv_state = self.conv_states[layer_idx]
        cache_position = cache_position.clamp(0, self.conv_kernel_size - 1)

        conv_state = conv_state.roll(shifts=-1, dims=-1)
        conv_state[:, :, cache_position] = new_conv_state.to(conv_state.device)
        self.conv_states[layer_idx].zero_()
        self.conv_states[layer_idx] += conv_state
        return self.conv_states[layer_idx]

    def update_ssm_state(self, layer_idx, new_ssm_state):
        self.ssm_states[layer_idx] = new_ssm_state.to(self.ssm_states.device)
        return self.ssm_states[layer_idx]


def rms_forward(hidden_states, variance_epsilon=1e-6):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + variance_epsilon)
    return hidden_states.to(input_dtype)


class FalconMambaMixer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.ssm_state_size = config.state_size
        self.conv_kernel_size = config.conv_kernel
        self.intermediate_size = config.intermediate_size
        self.time_step_rank = int(config.time_step_rank)
        self.layer_idx = layer_idx
        self.use_conv_bias = config.use_conv_bias
        self.conv1d = nn.Conv1d(
            in_channels=self.intermediate_size,
            out_channels=self.intermediate_size,
            bias=config.use_conv_bias,
            kernel_size=config.conv_kernel,
            groups=self.intermediate_size,
            padding=config.conv_kernel - 1,
        )
        self.act = nn.SiLU()
        self.in_proj = nn.Linear(self.hidden_size, self.intermediate_size * 2, bias=config.use_bias)
        self.x_proj = nn.Linear(self.intermediate_size, self.time_step_rank + self.ssm_state_size * 2, bias=False)
        self.dt_proj = nn.Linear(self.time_step_rank, self.intermediate_size, bias=True)

        A = torch.arange(1, self.ssm_state_size + 1, dtype=torch.float32)[None, :]
        A = A.expand(self.intermediate_size, -1).contiguous()
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(self.intermediate_size))
        self.out_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.use_bias)
        self.rms_eps = config.mixer_rms_eps

    def slow_forward(self, input_states, cache_params=None, cache_position=None, attention_mask=None):
        batch_size, seq_len, _ = input_states.shape
        dtype = input_states.dtype
        # 1. Gated MLP's linear projection
        projected_states = self.in_proj(input_states).transpose(1, 2)  # [batch, 2 * intermediate_size, seq_len]
        hidden_states, gate = projected_states.chunk(2, dim=1)

        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)

        # 2. Convolution sequence transformation
        if cache_params is not None:
            ssm_state = cache_params.ssm_states[self.layer_idx].clone()
            ssm_state = ssm_state.to(hidden_states.device)
            # use `cache_position.shape[0]` to check whether we are in prefill stage
            if cache_position.shape[0] == self.conv_kernel_size:
                conv_state = nn.functional.pad(hidden_states, (self.conv_kernel_size - hidden_states.shape[-1], 0))

                cache_params.update_conv_state(self.layer_idx, conv_state, cache_position)
                hidden_states = self.act(self.conv1d(hidden_states)[..., :seq_len])  # [batch, intermediate_size, seq_len]
            else:
                conv_state = cache_params.update_conv_state(self.layer_idx, hidden_states, cache_position)
                hidden_states = torch.sum(conv_state * self.conv1d.weight[:, 0, :], dim=-1)
                if self.use_conv_bias:
                    hidden_states += self.conv1d.bias
                hidden_states = self.act(hidden_states).to(dtype).unsqueeze(-1)  # [batch, intermediate_size, 1]
        else:
            ssm_state = torch.zeros(
                (batch_size, self.intermediate_size, self.ssm_state_size), device=hidden_states.device, dtype=dtype
            )
            hidden_states = self.act(self.conv1d(hidden_states)[..., :seq_len])  # [batch, intermediate_size, seq_len]

        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)

        # 3. State Space Model sequence transformation
        # 3.a. Selection:  [batch, seq_len, self.time_step_rank + self.ssm_state_size * 2]
        ssm_parameters = self.x_proj(hidden_states.transpose(1, 2))
        time_step, B, C = torch.split(
            ssm_parameters, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )

        B = rms_forward(B, variance_epsilon=self.rms_eps)
        C = rms_forward(C, variance_epsilon=self.rms_eps)
        time_step = rms_forward(time_step, variance_epsilon=self.rms_eps)

        discrete_time_step = self.dt_proj(time_step)  # [batch, seq_len, intermediate_size]
        discrete_time_step = nn.functional.softplus(discrete_time_step).transpose(1, 2)  # [batch, intermediate_size, seq_len]

        # 3.b. Discretization: B and C to [batch, seq_len, intermediate_size, ssm_state_size] (SRAM)
        A = -torch.exp(self.A_log.float())  # [intermediate_size, ssm_state_size]
        discrete_A = torch.exp(A[None, :, None, :] * discrete_time_step[:, :, :, None])
        discrete_B = discrete_time_step[:, :, :, None] * B[:, None, :, :].float()
        deltaB_u = discrete_B * hidden_states[:, :, :, None].float()

        # 3.c perform the recurrence y <- SSM(A, B, C)(x)
        scan_outputs = []
        for i in range(seq_len):
            ssm_state = discrete_A[:, :, i, :] * ssm_state + deltaB_u[:, :, i, :]  # [batch, intermediade_size, ssm_state]
            scan_output = torch.matmul(ssm_state.to(dtype), C[:, i, :].unsqueeze(-1))  # [batch, intermediade_size, 1]
            scan_outputs.append(scan_output[:, :, 0])
        scan_output = torch.stack(scan_outputs, dim=-1)  # [batch, intermediade_size, seq_len]
        scan_output = scan_output + (hidden_states * self.D[None, :, None])
        scan_output = scan_output * self.act(gate)

        if cache_params is not None:
            cache_params.ssm_states[self.layer_idx].copy_(ssm_state)

        # 4. Final linear projection
        contextualized_states = self.out_proj(scan_output.transpose(1, 2))  # [batch, seq_len, hidden_size]
        return contextualized_states

    def forward(self, hidden_states, cache_params=None, cache_position=None, attention_mask=None):
        # (the CUDA kernels path is not available on CPU: the slow path runs, as upstream)
        return self.slow_forward(hidden_states, cache_params, cache_position, attention_mask)


class FalconMambaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class FalconMambaBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = FalconMambaRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = FalconMambaMixer(config, layer_idx=layer_idx)

    if FIXED:
        def forward(self, hidden_states, cache_params=None, cache_position=None, attention_mask=None):
            residual = hidden_states
            hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)

            hidden_states = self.mixer(
                hidden_states, cache_params=cache_params, cache_position=cache_position, attention_mask=attention_mask
            )
            hidden_states = residual + hidden_states
            return hidden_states
    else:
        def forward(self, hidden_states, cache_params=None, cache_position=None):
            residual = hidden_states
            hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)

            hidden_states = self.mixer(hidden_states, cache_params=cache_params, cache_position=cache_position)
            hidden_states = residual + hidden_states
            return hidden_states


class FalconMambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([FalconMambaBlock(config, layer_idx=idx) for idx in range(config.num_hidden_layers)])
        self.norm_f = FalconMambaRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids=None, cache_params=None, use_cache=None, cache_position=None, attention_mask=None):
        inputs_embeds = self.embeddings(input_ids)

        if use_cache:
            if cache_params is None:
                cache_params = FalconMambaCache(self.config, inputs_embeds.size(0), dtype=inputs_embeds.dtype)
                cache_position = torch.arange(0, self.config.conv_kernel, device=inputs_embeds.device)
        else:
            cache_params = None

        hidden_states = inputs_embeds
        for mixer_block in self.layers:
            if FIXED:
                hidden_states = mixer_block(
                    hidden_states,
                    cache_params=cache_params,
                    cache_position=cache_position,
                    attention_mask=attention_mask,
                )
            else:
                hidden_states = mixer_block(hidden_states, cache_params=cache_params, cache_position=cache_position)

        hidden_states = self.norm_f(hidden_states)
        return hidden_states, cache_params


class FalconMambaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.backbone = FalconMambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # tie_word_embeddings=False

    def prepare_inputs_for_generation(self, input_ids, cache_params=None, use_cache=None,
                                      cache_position=None, attention_mask=None):
        if use_cache:
            if cache_position[0] > 0:
                input_ids = input_ids[:, -1].unsqueeze(-1)
                if FIXED and attention_mask is not None:
                    attention_mask = None
            else:
                # we initialize the `cache_position` to full size of `conv_states` at prefill stage
                cache_position = torch.arange(0, self.config.conv_kernel, device=input_ids.device)
        return {
            "input_ids": input_ids,
            "cache_params": cache_params,
            "use_cache": use_cache,
            "cache_position": cache_position,
            "attention_mask": attention_mask,
        }

    def forward(self, input_ids=None, cache_params=None, use_cache=None, cache_position=None, attention_mask=None):
        hidden_states, cache_params = self.backbone(
            input_ids, cache_params=cache_params, use_cache=use_cache,
            cache_position=cache_position, attention_mask=attention_mask,
        )
        logits = self.lm_head(hidden_states.to(self.lm_head.weight.dtype)).float()
        return logits, cache_params


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_new_tokens):
    # GenerationMixin's greedy loop for Mamba: cache_position starts at arange(prompt_len),
    # _update_model_kwargs_for_generation extends the mask with a 1 and moves cache_position on.
    cache_params = None
    cache_position = torch.arange(input_ids.shape[1])
    first_logits = None
    for _ in range(max_new_tokens):
        model_inputs = model.prepare_inputs_for_generation(
            input_ids, cache_params=cache_params, use_cache=True,
            cache_position=cache_position, attention_mask=attention_mask,
        )
        logits, cache_params = model(**model_inputs)
        next_token_logits = logits[:, -1, :]
        if first_logits is None:
            first_logits = next_token_logits.clone()
        next_tokens = next_token_logits.argmax(dim=-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        cache_position = cache_position[-1:] + 1
    return input_ids, first_logits


def main():
    config = FalconMambaConfig()
    model = FalconMambaForCausalLM(config).eval()
    with torch.no_grad():
        model.backbone.embeddings.weight.normal_(0.0, 1.0)
        for layer in model.backbone.layers:
            layer.mixer.dt_proj.bias.uniform_(-2.0, 0.5)
            layer.mixer.conv1d.bias.normal_(0.0, 0.5)

    # Two prompts of different lengths, left-padded with pad_token_id (tokenizer.padding_side = "left")
    prompts = [[5, 17, 9], [11, 3, 22, 8, 30, 14, 6, 19]]
    max_len = max(len(p) for p in prompts)
    pad = config.pad_token_id
    input_ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])
    print("input_ids     ", input_ids.tolist())
    print("attention_mask", attention_mask.tolist())

    out, first_logits = greedy_generate(model, input_ids, attention_mask, max_new_tokens=8)
    print("batched generate, new tokens:", out[:, max_len:].tolist())
    print("batched first-step logits[:, :5]:", [[round(v, 4) for v in row] for row in first_logits[:, :5].tolist()])

    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        single_out, single_logits = greedy_generate(model, ids, torch.ones_like(ids), max_new_tokens=8)
        print(f"prompt {i} alone, new tokens:", single_out[:, len(p):].tolist()[0],
              " first-step logits[:5]:", [round(v, 4) for v in single_logits[0, :5].tolist()])


if __name__ == "__main__":
    main()
