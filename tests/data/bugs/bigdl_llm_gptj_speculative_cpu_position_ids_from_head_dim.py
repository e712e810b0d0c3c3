# intel/ipex-llm PR #10141 (commit 1508d6b, "Fix gptj kvcache & position id"),
# python/llm/src/bigdl/llm/transformers/speculative.py, speculative_generate (CPU path).
#
# BigDL-LLM's self-speculative decoding hands GPT-J explicit position_ids for each draft
# step and for the target's verify step, counted from the cache length. GPT-J's cache is
# laid (bsz, num_heads, seq, head_dim), but the code read past_key_values[0][0].size(1),
# i.e. the number of heads: every draft token and every verify window is rotated as if it
# sat at position n_head, n_head + 1, ... whatever the real offset in the cache. The fix
# reads size(2), the cache's sequence length (and trims the cache on dim 2 as well).
#
# The model below is GPT-J as transformers 4.36 wrote it (tuple KV cache, rotary
# position_ids), built from a tiny GPTJConfig; the draft model stands in for the int4
# copy of the same checkpoint that BigDL uses as the self-speculative draft.
import copy
import math
import sys
import time

import torch
import torch.nn as nn
from transformers import GPTJConfig, LogitsProcessorList
from transformers.modeling_outputs import CausalLMOutputWithPast

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- GPT-J (transformers 4.36)
def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(num_pos, dtype=torch.int64).float(), inv_freq).float()
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.register_buffer("masked_bias", torch.tensor(-1e9), persistent=False)
        self.embed_dim = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_attention_heads
        self.scale_attn = torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float32)).to(torch.get_default_dtype())
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.rotary_dim = config.rotary_dim
        pos_embd_dim = self.rotary_dim or self.embed_dim
        self.embed_positions = create_sinusoidal_positions(max_positions, pos_embd_dim)

    def _split_heads(self, tensor, num_attention_heads, attn_head_size, rotary):
        new_shape = tensor.size()[:-1] + (num_attention_heads, attn_head_size)
        tensor = tensor.view(new_shape)
        if rotary:
            return tensor
        if len(tensor.shape) == 5:
            return tensor.permute(0, 1, 3, 2, 4)
        elif len(tensor.shape) == 4:
            return tensor.permute(0, 2, 1, 3)
        raise ValueError(f"Input tensor rank should be one of [4, 5], but is: {len(tensor.shape)}")

    def _merge_heads(self, tensor, num_attention_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_attention_heads * attn_head_size,)
        return tensor.view(new_shape)

    def _attn(self, query, key, value, attention_mask=None):
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        query = query.to(torch.float32)
        key = key.to(torch.float32)
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.tensor(mask_value, dtype=attn_weights.dtype).to(attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = attn_weights / self.scale_attn
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.to(value.dtype)
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def forward(self, hidden_states, layer_past=None, attention_mask=None, position_ids=None, use_cache=False):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)

        query = self._split_heads(query, self.num_attention_heads, self.head_dim, True)
        key = self._split_heads(key, self.num_attention_heads, self.head_dim, True)
        value = self._split_heads(value, self.num_attention_heads, self.head_dim, False)

        embed_positions = self.embed_positions.to(position_ids.device)
        repeated_position_ids = position_ids.unsqueeze(-1).repeat(1, 1, embed_positions.shape[-1])
        sincos = torch.gather(embed_positions.unsqueeze(0).repeat(position_ids.shape[0], 1, 1), 1,
                              repeated_position_ids)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)

        if self.rotary_dim is not None:
            k_rot = key[:, :, :, : self.rotary_dim]
            k_pass = key[:, :, :, self.rotary_dim :]
            q_rot = query[:, :, :, : self.rotary_dim]
            q_pass = query[:, :, :, self.rotary_dim :]
            k_rot = apply_rotary_pos_emb(k_rot, sin, cos)
            q_rot = apply_rotary_pos_emb(q_rot, sin, cos)
            key = torch.cat([k_rot, k_pass], dim=-1)
            query = torch.cat([q_rot, q_pass], dim=-1)
        else:
            key = apply_rotary_pos_emb(key, sin, cos)
            query = apply_rotary_pos_emb(query, sin, cos)

        key = key.permute(0, 2, 1, 3)
        query = query.permute(0, 2, 1, 3)

        if layer_past is not None:
            past_key = layer_past[0]
            past_value = layer_past[1]
            key = torch.cat((past_key.to(key.dtype), key), dim=-2)
            value = torch.cat((past_value.to(value.dtype), value), dim=-2)

        present = (key, value) if use_cache else None

        attn_output, attn_weights = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, present


class GPTJMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        embed_dim = config.n_embd
        self.fc_in = nn.Linear(embed_dim, intermediate_size)
        self.fc_out = nn.Linear(intermediate_size, embed_dim)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, hidden_states):
        return self.fc_out(self.act(self.fc_in(hidden_states)))


class GPTJBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPTJAttention(config)
        self.mlp = GPTJMLP(inner_dim, config)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, position_ids=None, use_cache=False):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, present = self.attn(hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                                         position_ids=position_ids, use_cache=use_cache)
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = attn_output + feed_forward_hidden_states + residual
        return hidden_states, present


class GPTJForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([GPTJBlock(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)

    @property
    def device(self):
        return self.lm_head.weight.device

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, position_ids=None,
                use_cache=None, return_dict=True):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        batch_size = input_ids.shape[0]
        device = input_ids.device

        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)

        if position_ids is None:
            position_ids = torch.arange(past_length, input_shape[-1] + past_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0)

        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = attention_mask.to(dtype=self.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(self.dtype).min

        hidden_states = self.wte(input_ids)
        presents = () if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(hidden_states, layer_past=layer_past, attention_mask=attention_mask,
                                           position_ids=position_ids, use_cache=use_cache)
            if use_cache:
                presents = presents + (present,)
        hidden_states = self.ln_f(hidden_states)
        lm_logits = self.lm_head(hidden_states).to(torch.float32)
        return CausalLMOutputWithPast(logits=lm_logits, past_key_values=presents)


# ---------------------------------------------------------------- bigdl speculative (CPU)
def greedy(logits, return_probs: bool = False):
    if return_probs:
        all_probs = logits.softmax(-1)
        probs, output_ids = torch.max(all_probs, dim=-1)
        return output_ids, probs
    else:
        output_ids = torch.argmax(logits, dim=-1)
        return output_ids


def _prepare_past_key_values_storage_cpu(self, past_key_values, max_new_tokens, _enable_ipex=False):
    past_key_values_storage = []
    for i in range(len(past_key_values)):
        len0 = past_key_values[i][0].size(0)
        len1 = past_key_values[i][0].size(1)
        len2 = past_key_values[i][0].size(2)
        len3 = past_key_values[i][0].size(3)
        k0 = torch.ones(len0, len1, len2 + max_new_tokens, len3, dtype=torch.float32)
        v0 = torch.ones(len0, len1, len2 + max_new_tokens, len3, dtype=torch.float32)
        past_key_values_storage.append((k0, v0))
        past_key_values_storage[i][0][:, :, :len2, :] = past_key_values[i][0].to(torch.float32)
        past_key_values_storage[i][1][:, :, :len2, :] = past_key_values[i][1].to(torch.float32)
    return past_key_values_storage


def _prepare_draft_past_key_values_cpu(self, past_key_values, past_key_values_storage):
    tmp_past_key_values = []
    for i in range(len(past_key_values)):
        len2 = past_key_values[0][0].size(2)
        k0 = past_key_values_storage[i][0][:, :, :len2, :]
        v0 = past_key_values_storage[i][1][:, :, :len2, :]
        tmp_past_key_values.append((k0, v0))
    return tmp_past_key_values


def _update_past_key_values_storage_cpu(self, past_key_values, past_key_values_storage,
                                        original_draft_past_key_values, _enable_ipex=False):
    for i in range(len(past_key_values)):
        size = original_draft_past_key_values[i][0].size(2)
        size1 = past_key_values[i][0].size(2)
        past_key_values_storage[i][0][:, :, size:size1, :] = \
            past_key_values[i][0][:, :, size:size1, :].to(torch.float32)
        past_key_values_storage[i][1][:, :, size:size1, :] = \
            past_key_values[i][1][:, :, size:size1, :].to(torch.float32)


@torch.no_grad()
def speculative_generate(self, input_ids, draft_model=None, max_new_tokens=10, max_step_draft=8,
                         th_stop_draft=0.8, auto_th_stop_draft=True,
                         auto_parameters=[1, 0.5, 0.9, 1e-2, 0.9], hf_adjust=False,
                         attention_mask=None, eos_token_id=None):
    logits_processor = LogitsProcessorList()
    step = 0
    step_draft = 0
    step_verify = 0

    draft_gen_length = max_step_draft + 6 if hf_adjust else max_step_draft + 1
    current_input_ids = input_ids
    generate_ids = torch.empty([input_ids.size(0), max_new_tokens + max_step_draft],
                               dtype=torch.long, device=self.device)
    draft_generate_ids = torch.empty([input_ids.size(0), draft_gen_length],
                                     dtype=torch.long, device=self.device)
    past_key_values = None
    past_key_values_storage = []
    _enable_ipex = False
    tmp_matchness = 0
    self.accept_num = []

    while True:
        if step >= max_new_tokens:
            break

        if step == 0:
            # first token use full model
            output = self(input_ids=current_input_ids,
                          past_key_values=past_key_values,
                          attention_mask=attention_mask,
                          return_dict=True,
                          use_cache=True)
            logits = output['logits']
            logits = logits[:, -1:]
            logits[:, -1, :] = logits_processor(current_input_ids, logits[:, -1, :])
            output_ids = greedy(logits)
            generate_ids[:, step] = output_ids
            current_input_ids = output_ids
            past_key_values = output['past_key_values']
            step += 1
        else:
            draft_current_input_ids = current_input_ids
            # Target model KV cache to draft model
            if self.device.type == 'cpu':
                if step == 1:
                    past_key_values_storage = \
                        _prepare_past_key_values_storage_cpu(self, past_key_values,
                                                             max_new_tokens, _enable_ipex)
                draft_past_key_values = \
                    _prepare_draft_past_key_values_cpu(self, past_key_values,
                                                       past_key_values_storage)
                original_draft_past_key_values = draft_past_key_values
            else:
                draft_past_key_values = past_key_values
            draft_generate_ids[:, 0] = current_input_ids
            random_probs = None
            for step_draft in range(max_step_draft):
                if attention_mask is None:
                    draft_attention_mask = None
                else:
                    appended_len = step_draft + step
                    ones_to_append = torch.ones(attention_mask.size(0), appended_len)
                    draft_attention_mask = torch.cat((attention_mask, ones_to_append), dim=1)
                forward_args = {
                    "input_ids": draft_current_input_ids,
                    "past_key_values": draft_past_key_values,
                    "attention_mask": draft_attention_mask,
                    "return_dict": True,
                    "use_cache": True,
                }
                if self.config.model_type == "gptj":
                    if FIXED:
                        past_length = draft_past_key_values[0][0].size(2)
                    else:
                        past_length = draft_past_key_values[0][0].size(1)
                    position_ids = torch.Tensor([[past_length]]).long().to(self.device)
                    forward_args["position_ids"] = position_ids
                draft_output = draft_model(**forward_args)
                temp_input_ids = torch.cat((input_ids, generate_ids[:, :step],
                                            draft_generate_ids[:, 1:step_draft + 1]), dim=-1)
                logits = draft_output['logits']
                logits[:, -1, :] = logits_processor(temp_input_ids,
                                                    draft_output['logits'][:, -1, :])
                draft_output_ids, draft_output_probs = greedy(logits, return_probs=True)
                draft_generate_ids[:, step_draft + 1] = draft_output_ids
                draft_current_input_ids = draft_output_ids
                draft_past_key_values = draft_output['past_key_values']
                th_random = 1 if random_probs is None else random_probs[step_draft]
                if (draft_output_probs.item() < th_stop_draft and th_random > 0.3) or \
                        step + step_draft + 2 >= max_new_tokens:
                    break
            drafted_n_tokens = step_draft + 1
            drafted_input_ids = draft_generate_ids[:, :drafted_n_tokens + 1]
            # Target model verify drafts
            if attention_mask is None:
                cur_attention_mask = None
            else:
                appended_len = drafted_input_ids.size(1) + step - 1
                ones_to_append = torch.ones(attention_mask.size(0), appended_len)
                cur_attention_mask = torch.cat((attention_mask, ones_to_append), dim=1)
            forward_args = {
                "input_ids": drafted_input_ids,
                "past_key_values": past_key_values,
                "attention_mask": cur_attention_mask,
                "return_dict": True,
                "use_cache": True,
            }
            if self.config.model_type == "gptj":
                if FIXED:
                    past_length = past_key_values[0][0].size(2)
                else:
                    past_length = past_key_values[0][0].size(1)
                input_len = drafted_input_ids.shape[1]
                position_ids = torch.arange(past_length, input_len + past_length,
                                            dtype=torch.long, device=drafted_input_ids.device)
                position_ids = position_ids.unsqueeze(0).view(-1, input_len)
                forward_args["position_ids"] = position_ids
            output = self(**forward_args)
            if isinstance(output, dict):
                logits = output['logits']
                past_key_values = output['past_key_values']
            temp_input_ids = torch.cat((input_ids, generate_ids[:, :step],
                                        draft_generate_ids[:, 1:step_draft + 2]), dim=-1)
            for i in range(logits.size(1)):
                logits[:, i, :] = logits_processor(temp_input_ids[:, :input_ids.size(1) + step + i],
                                                   logits[:, i, :])
            output_ids = greedy(logits)
            past_key_values = output['past_key_values']

            max_matched = ((output_ids[:, :-1] != drafted_input_ids[:, 1:]).cumsum(-1) == 0)
            max_matched = max_matched.sum(-1).item() + 1

            max_of_max_matched = output_ids.size(1)
            self.accept_num.append(max_matched)
            # Clean up target model KV cache
            if max_of_max_matched != max_matched:
                output_ids = output_ids[:, :max_matched]
                if self.config.model_type in (["qwen"] if FIXED else ["qwen", "gptj"]):
                    past_key_values = [
                        (k[:, :-(max_of_max_matched - max_matched), :],
                         v[:, :-(max_of_max_matched - max_matched), :])
                        for k, v in past_key_values
                    ]
                elif self.config.model_type in (["baichuan", "gptj"] if FIXED else ["baichuan"]):
                    past_key_values = [
                        (k[:, :, :-(max_of_max_matched - max_matched), :],
                         v[:, :, :-(max_of_max_matched - max_matched), :])
                        for k, v in past_key_values
                    ]
                else:
                    past_key_values = [
                        (k[:, :, :-(max_of_max_matched - max_matched)],
                         v[:, :, :-(max_of_max_matched - max_matched)])
                        for k, v in past_key_values
                    ]

            if self.device.type == 'cpu':
                _update_past_key_values_storage_cpu(self, past_key_values, past_key_values_storage,
                                                    original_draft_past_key_values, _enable_ipex)

            generate_ids[:, step:step + output_ids.size(1)] = output_ids
            current_input_ids = output_ids[:, -1:]
            step += output_ids.size(1)
            step_verify += 1

            if auto_th_stop_draft and step_verify % auto_parameters[0] == 0:
                tmp_matchness = auto_parameters[1] * (tmp_matchness) + \
                    (1 - auto_parameters[1]) * ((max_matched - 1) / drafted_n_tokens)
                if tmp_matchness < auto_parameters[2]:
                    new_th_stop_draft = th_stop_draft + auto_parameters[3]
                else:
                    if drafted_n_tokens == max_step_draft:
                        new_th_stop_draft = th_stop_draft
                    else:
                        new_th_stop_draft = th_stop_draft - auto_parameters[3]
                th_stop_draft = auto_parameters[4] * th_stop_draft + \
                    (1 - auto_parameters[4]) * new_th_stop_draft

        output_ids_list = output_ids[0].tolist()
        if eos_token_id in output_ids_list:
            idx = output_ids_list.index(eos_token_id)
            step -= (len(output_ids_list) - idx - 1)
            break

    step = min(step, max_new_tokens)
    generate_ids = torch.cat([input_ids, generate_ids[:, :step]], dim=-1)
    return generate_ids


def main():
    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=96, n_positions=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                        bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = GPTJForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    # self-speculative: the draft is the same checkpoint (BigDL loads it again in int4)
    draft_model = copy.deepcopy(model)
    model.draft_model = draft_model

    input_ids = torch.randint(1, config.vocab_size, (1, 12))
    out = speculative_generate(model, input_ids, draft_model=draft_model, max_new_tokens=16)
    print("generated:", out[0, input_ids.shape[1]:].tolist())
    print("accepted per verify step:", model.accept_num)


if __name__ == "__main__":
    main()
