# Citation: abertsch72/unlimiformer commit 1a74833 ("fix window indices for decoder-only"), src/unlimiformer.py
# Unlimiformer.window_indices (copied from SLED) and Unlimiformer.reset_memory.
#
# Unlimiformer encodes a prompt longer than the model's window in overlapping chunks of model_encoder_max_len
# tokens (chunk_overlap = 0.5 in run_generation.py), and keeps, for every layer, the keys/values of each
# chunk's "update" slice [update_start_ind, update_end_ind); at decode time each query retrieves its top-k keys
# from that store. window_indices was written for encoders: it drops a window_margin at both ends of every
# window. For a decoder-only (causal) model the first window also stopped window_margin tokens short, so the
# keys of tokens [max_len - margin, max_len) were taken from the second window, where they see only the tokens
# from that window's start (and sit at smaller positions) instead of the whole first window.
# Fix: for decoder-only models the first window updates up to context_end (update_end_ind = context_end).
#
# Trimmed port: a tiny LlamaForCausalLM (random weights) with Unlimiformer's ActivationCapturer on each
# layer's k_proj / v_proj / q_proj, reset_memory's chunk loop (the non-datastore path that keeps prompt_keys,
# prompt_values and prompt_attention_mask), and attention_forward_hook's top-k retrieval for the last query.
import sys

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ActivationCapturer(nn.Module):
    def __init__(self, layer, capture_input=False):
        super().__init__()
        self.layer = layer
        self.capture_input = capture_input
        self.captured = None

    def unwrap_tuple(self, t):
        if isinstance(t, tuple) and len(t) == 1:
            t = t[0]
        return t

    def forward(self, module, layer_input, layer_output):
        if self.capture_input:
            self.captured = self.unwrap_tuple(layer_input)
        else:
            self.captured = self.unwrap_tuple(layer_output)


class UnlimiformerLLaMa:
    def __init__(self, model, layer_begin=0, layer_end=None, model_encoder_max_len=None, chunk_overlap=0.5,
                 exclude_attention=False):
        self.model = model
        self.layer_begin = layer_begin
        self.layer_end = layer_end
        self.exclude_attention = exclude_attention
        self.model_encoder_max_len = model_encoder_max_len
        self.chunk_overlap = chunk_overlap
        self.is_encoder_decoder = model.config.is_encoder_decoder
        self.num_heads = model.config.num_attention_heads
        self.head_dim = model.config.hidden_size // self.num_heads
        self.device = torch.device("cpu")
        self.break_into(model)

    def break_into(self, model):
        self.actual_model_window_size = self.window_size()
        if self.model_encoder_max_len is None:
            self.model_encoder_max_len = self.actual_model_window_size
        self.window_margin = int(self.model_encoder_max_len * self.chunk_overlap / 2)
        self.activation_capturer = []
        for k_proj, v_proj in self.get_kv_projections(self.layer_begin, self.layer_end):
            kc, vc = ActivationCapturer(k_proj), ActivationCapturer(v_proj)
            k_proj.register_forward_hook(kc)
            v_proj.register_forward_hook(vc)
            self.activation_capturer.append((kc, vc))
        self.query_capturer = []
        for q_proj in self.attention_op_to_run(self.layer_begin, self.layer_end):
            qc = ActivationCapturer(q_proj)
            q_proj.register_forward_hook(qc)
            self.query_capturer.append(qc)

    def get_kv_projections(self, layer_begin, layer_end):
        return [[layer.self_attn.k_proj, layer.self_attn.v_proj]
                for layer in self.model.base_model.layers[layer_begin:layer_end]]

    def attention_op_to_run(self, layer_begin, layer_end):
        return [layer.self_attn.q_proj for layer in self.model.base_model.layers[layer_begin:layer_end]]

    def window_size(self):
        return self.model.config.max_position_embeddings

    def process_key_value(self, capturers):
        key_capturer, value_capturer = capturers
        key, value = key_capturer.captured, value_capturer.captured
        key = key.view(key.shape[0], -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous()
        value = value.view(value.shape[0], -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous()
        return key, value

    def process_query(self, output):
        return output.view(output.shape[0], output.shape[1], self.num_heads, self.head_dim).contiguous()

    def window_indices(self, total_seq_len):
        # Copied from SLED (Ivgy et al., 2022)
        if total_seq_len <= self.model_encoder_max_len:
            return [(0, total_seq_len, 0, total_seq_len)]
        else:
            results = []
            stride = self.model_encoder_max_len - 2 * self.window_margin
            context_start = update_start_ind = 0
            context_end = self.model_encoder_max_len
            if FIXED:
                if self.is_encoder_decoder:
                    update_end_ind = context_end - self.window_margin
                else:
                    update_end_ind = context_end
            else:
                update_end_ind = context_end - self.window_margin
            # first window always should update from the beginning
            results.append((context_start, context_end, update_start_ind, update_end_ind))

            while context_end < total_seq_len:
                context_end = min(total_seq_len, context_end + stride)
                context_start = (
                    context_start + stride if context_end < total_seq_len else total_seq_len - self.model_encoder_max_len
                )
                update_start_ind = max(update_start_ind + stride, update_end_ind)
                # last window always should update until the end
                update_end_ind = (
                    min(total_seq_len, update_end_ind + stride) if context_end < total_seq_len else total_seq_len
                )
                cs, ce, us, ue = context_start, context_end, update_start_ind - context_start, \
                    update_end_ind - context_start
                results.append((cs, ce, us, ue))
            return results

    def reset_memory(self, input_ids, attention_mask):
        self.prompt_input_ids = input_ids
        self.input_ids_size = input_ids.shape[-1]
        n_layers = len(self.activation_capturer)
        self.prompt_keys = [[] for _ in range(n_layers)]
        self.prompt_values = [[] for _ in range(n_layers)]
        self.prompt_attention_mask = []
        window_indices = self.window_indices(input_ids.shape[-1])
        for context_start_ind, context_end_ind, update_start_ind, update_end_ind in window_indices:
            chunk = input_ids[:, context_start_ind:context_end_ind].to(self.device)
            chunk_attention_mask = attention_mask[:, context_start_ind:context_end_ind].to(self.device)
            with torch.inference_mode():
                _ = self.model(chunk, attention_mask=chunk_attention_mask)
            layers_kv = [self.process_key_value(layer_capturer) for layer_capturer in self.activation_capturer]
            key = [layer[0][:, :, update_start_ind:update_end_ind] for layer in layers_kv]
            value = [layer[1][:, :, update_start_ind:update_end_ind] for layer in layers_kv]
            chunk_attention_mask = chunk_attention_mask[:, update_start_ind:update_end_ind]
            for i, (layer_key, layer_value) in enumerate(zip(key, value)):
                self.prompt_keys[i].append(layer_key)
                self.prompt_values[i].append(layer_value)
            self.prompt_attention_mask.append(chunk_attention_mask)
        for i, (layer_keys, layer_values) in enumerate(zip(self.prompt_keys, self.prompt_values)):
            self.prompt_keys[i] = torch.cat(layer_keys, dim=-2)
            self.prompt_values[i] = torch.cat(layer_values, dim=-2)
        self.prompt_attention_mask = torch.cat(self.prompt_attention_mask, dim=-1)

    def retrieve(self, cur_decoder_layer_index, query):
        # attention_forward_hook, non-datastore path; query: (batch * beam, head, dim)
        prompt_size = self.prompt_input_ids.shape[1]
        generated_size = self.input_ids_size - prompt_size
        window_size = self.actual_model_window_size
        topk = min(prompt_size, window_size - generated_size + 1)
        this_layer_prompt_keys = self.prompt_keys[cur_decoder_layer_index]
        this_layer_prompt_values = self.prompt_values[cur_decoder_layer_index]
        batch_size = self.prompt_input_ids.shape[0]
        beam_size = query.shape[0] // batch_size
        query = query.reshape(batch_size, beam_size, *query.shape[1:])
        attn_weights = torch.matmul(this_layer_prompt_keys.unsqueeze(1), query.unsqueeze(-1)).squeeze(-1)
        prompt_attention_mask_to_add = (1 - self.prompt_attention_mask) * -1e9
        prompt_attention_mask_to_add = prompt_attention_mask_to_add.unsqueeze(1).unsqueeze(1)
        attn_weights += prompt_attention_mask_to_add
        if self.exclude_attention and attn_weights.shape[-1] > self.actual_model_window_size:
            attn_weights[..., :self.actual_model_window_size] -= 1e9
        top_key_scores, top_key_indices = torch.topk(attn_weights, k=topk, dim=-1, sorted=True)
        retrieved_keys = torch.take_along_dim(this_layer_prompt_keys.unsqueeze(1), indices=top_key_indices.unsqueeze(-1), dim=-2)
        retrieved_values = torch.take_along_dim(this_layer_prompt_values.unsqueeze(1), indices=top_key_indices.unsqueeze(-1), dim=-2)
        retrieved_keys = retrieved_keys.flatten(0, 1)[:, :, :topk]
        retrieved_values = retrieved_values.flatten(0, 1)[:, :, :topk]
        return retrieved_keys, retrieved_values, top_key_indices


config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8,
                     pad_token_id=0, attn_implementation="eager")
model = LlamaForCausalLM(config).eval()
unlimiformer = UnlimiformerLLaMa(model, layer_begin=0, chunk_overlap=0.5)

# a prompt of 20 tokens, 2.5x the model's window; the second row is left-padded by 2
input_ids = torch.randint(1, 64, (2, 20))
attention_mask = torch.ones_like(input_ids)
input_ids[1, :2] = 0
attention_mask[1, :2] = 0

unlimiformer.reset_memory(input_ids, attention_mask)

# the first decoding step: the model sees the last window of the prompt (pre_generate_hook for decoder-only)
with torch.inference_mode():
    out = model(input_ids[:, -unlimiformer.actual_model_window_size:],
                attention_mask=attention_mask[:, -unlimiformer.actual_model_window_size:])
outputs = []
for layer_index, qc in enumerate(unlimiformer.query_capturer):
    query = unlimiformer.process_query(qc.captured)[:, -1]  # (batch, head, dim)
    k, v, idx = unlimiformer.retrieve(layer_index, query)
    scores = torch.matmul(query.unsqueeze(-2), k.transpose(-1, -2)) / unlimiformer.head_dim ** 0.5
    attn = torch.softmax(scores, dim=-1)
    outputs.append(torch.matmul(attn, v).squeeze(-2))
    print(f"layer {layer_index}: retrieved indices (row 0, head 0) {sorted(idx[0, 0, 0].tolist())}")

print("windows:", unlimiformer.window_indices(input_ids.shape[-1]))
print("retrieved-attention output, layer 1, row 0 head 0:", [round(x, 4) for x in outputs[1][0, 0].tolist()])
print("sum |output|:", round(sum(o.abs().sum().item() for o in outputs), 6))
