# oobabooga/text-generation-webui#4145 (commit cb26163a, "Fix off-by-one error in exllama_hf caching
# logic"; the prefix matching came in 03dc69ed). The ExLlamav2_HF loader keeps one ExLlamaV2Cache across
# calls and requests: it finds the longest common prefix between the new input_ids and the previous
# call's sequence (past_seq), sets cache.current_seq_len to it, prefills what is missing except the last
# token, then forwards input_ids[-1]. When the whole new prompt is a prefix of past_seq (regenerating
# from the same prompt), current_seq_len = len(prompt): the last token, already cached, is written again
# one slot further, at the next position, and every later step attends to it twice ("a" is seen as "a a").
# Fix: in that case back the cache pointer up by one (ex_cache.current_seq_len -= 1).
# Trimmed port of modules/exllamav2_hf.py (Exllamav2HF.__call__) and of exllamav2 0.0.x (model.py
# forward/_forward/build_attn_mask, attn.py forward_torch, cache.py) for a tiny random Llama, float32 on
# CPU; HF generate's greedy loop is written out (prepare_inputs_for_generation passes all input_ids).
import math
import sys

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ExLlamaV2Config:
    def __init__(self):
        self.vocab_size = 64
        self.hidden_size = 64
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.num_key_value_groups = self.num_attention_heads // self.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = 128
        self.num_hidden_layers = 2
        self.max_seq_len = 64
        self.rotary_embedding_base = 10000.0
        self.rms_norm_eps = 1e-5
        self.no_flash_attn = True


class ExLlamaV2Cache:
    def __init__(self, model, batch_size=1, max_seq_len=-1):
        self.model = model
        self.max_seq_len = max_seq_len if max_seq_len != -1 else self.model.config.max_seq_len
        self.batch_size = batch_size
        self.key_states = []
        self.value_states = []
        self.current_seq_len = 0
        cfg = self.model.config
        for i in range(cfg.num_hidden_layers):
            self.key_states.append(torch.zeros(self.batch_size, self.max_seq_len, cfg.num_key_value_heads, cfg.head_dim))
            self.value_states.append(torch.zeros(self.batch_size, self.max_seq_len, cfg.num_key_value_heads, cfg.head_dim))


class ExLlamaV2RMSNorm(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(model.config.hidden_size))
        self.eps = model.config.rms_norm_eps

    def forward(self, x, **kwargs):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_(x, sin, cos, past_len):
    # in place, x: (batch, q_len, heads, head_dim), Llama (rotate-half) layout
    q_len, half = x.shape[1], x.shape[-1] // 2
    s = sin[past_len: past_len + q_len].view(1, q_len, 1, -1)
    c = cos[past_len: past_len + q_len].view(1, q_len, 1, -1)
    x1, x2 = x[..., :half].clone(), x[..., half:].clone()
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


class ExLlamaV2Attention(nn.Module):
    def __init__(self, model, layer_idx):
        super().__init__()
        self.__dict__["model"] = model  # back-reference, not a submodule
        self.layer_idx = layer_idx
        cfg = model.config
        self.input_layernorm = ExLlamaV2RMSNorm(model)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def repeat_kv(self, hidden_states, n_rep):
        if n_rep == 1:
            return hidden_states
        batch, num_key_value_heads, slen, head_dim = hidden_states.shape
        hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
        return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)

    def forward(self, hidden_states, cache=None, attn_mask=None, past_len=None):
        cfg = self.model.config
        batch_size, q_len, _ = hidden_states.size()
        past_len = 0 if cache is None else cache.current_seq_len
        residual = hidden_states
        post_norm = self.input_layernorm.forward(hidden_states)

        query_states = self.q_proj.forward(post_norm).view(batch_size, q_len, cfg.num_attention_heads, cfg.head_dim)
        key_states = self.k_proj.forward(post_norm).view(batch_size, q_len, cfg.num_key_value_heads, cfg.head_dim)
        value_states = self.v_proj.forward(post_norm).view(batch_size, q_len, cfg.num_key_value_heads, cfg.head_dim)

        rope_(query_states, self.model.sin, self.model.cos, past_len)
        rope_(key_states, self.model.sin, self.model.cos, past_len)

        if cache is not None:
            new_keys = cache.key_states[self.layer_idx].narrow(1, past_len, q_len).narrow(0, 0, batch_size)
            new_values = cache.value_states[self.layer_idx].narrow(1, past_len, q_len).narrow(0, 0, batch_size)
            new_keys.copy_(key_states)
            new_values.copy_(value_states)
            key_states = cache.key_states[self.layer_idx].narrow(1, 0, past_len + q_len)
            value_states = cache.value_states[self.layer_idx].narrow(1, 0, past_len + q_len)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        key_states = self.repeat_kv(key_states, cfg.num_key_value_groups).transpose(-1, -2)
        attn_weights = torch.matmul(query_states, key_states)
        attn_weights /= math.sqrt(cfg.head_dim)
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        value_states = self.repeat_kv(value_states, cfg.num_key_value_groups)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape((batch_size, q_len, cfg.hidden_size))
        return self.o_proj.forward(attn_output) + residual


class ExLlamaV2MLP(nn.Module):
    def __init__(self, model):
        super().__init__()
        cfg = model.config
        self.post_attention_layernorm = ExLlamaV2RMSNorm(model)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, hidden_states, **kwargs):
        post_norm = self.post_attention_layernorm.forward(hidden_states)
        y = nn.functional.silu(self.gate_proj(post_norm)) * self.up_proj(post_norm)
        return self.down_proj(y) + hidden_states


class ExLlamaV2Embedding(nn.Embedding):
    def forward(self, x, **kwargs):
        return super().forward(x)


class ExLlamaV2Head(nn.Linear):
    def forward(self, x, **kwargs):
        return super().forward(x)


class ExLlamaV2(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        modules = [ExLlamaV2Embedding(config.vocab_size, config.hidden_size)]
        for layer_idx in range(config.num_hidden_layers):
            modules += [ExLlamaV2Attention(self, layer_idx), ExLlamaV2MLP(self)]
        modules += [ExLlamaV2RMSNorm(self), ExLlamaV2Head(config.hidden_size, config.vocab_size, bias=False)]
        self.modules_ = nn.ModuleList(modules)
        self.head_layer_idx = len(modules) - 1
        self.last_kv_layer_idx = len(modules) - 4
        inv_freq = 1.0 / (config.rotary_embedding_base ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        freqs = torch.outer(torch.arange(config.max_seq_len).float(), inv_freq)
        self.sin, self.cos = freqs.sin(), freqs.cos()

    def build_attn_mask(self, batch_size, seq_len, past_len, input_mask, device):
        if input_mask is None and seq_len == 1:
            return None
        attn_mask = torch.zeros(batch_size, 1, seq_len, past_len + seq_len, device=device)
        attn_mask_triu = torch.triu(torch.full((seq_len - 1, seq_len - 1), -65504.0))
        attn_mask[:, :, : seq_len - 1, past_len + 1: past_len + seq_len] = attn_mask_triu
        return attn_mask

    def forward(self, input_ids, cache=None, input_mask=None, preprocess_only=False, last_id_only=False):
        q_len = input_ids.shape[-1]
        if cache is not None:
            assert cache.current_seq_len + q_len <= cache.max_seq_len, "Total sequence length exceeds cache size in model.forward"
        return self._forward(input_ids, cache, input_mask, preprocess_only, last_id_only)

    def _forward(self, input_ids, cache=None, input_mask=None, preprocess_only=False, last_id_only=False):
        batch_size, seq_len = input_ids.shape
        past_len = 0 if cache is None else cache.current_seq_len
        x = input_ids
        attn_mask = self.build_attn_mask(batch_size, seq_len, past_len, input_mask, "cpu")
        for idx, module in enumerate(self.modules_):
            if last_id_only and idx == self.head_layer_idx:
                x = x.narrow(-2, -1, 1)
            x = module.forward(x, cache=cache, attn_mask=attn_mask, past_len=past_len)
            if preprocess_only and idx == self.last_kv_layer_idx:
                x = None
                break
        if cache is not None:
            cache.current_seq_len += seq_len
        return x


class Exllamav2HF:
    def __init__(self, config):
        self.ex_config = config
        self.ex_model = ExLlamaV2(config).eval()
        self.ex_cache = ExLlamaV2Cache(self.ex_model)
        self.past_seq = None

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        use_cache = kwargs.get('use_cache', True)
        labels = kwargs.get('labels', None)
        input_ids = kwargs['input_ids']
        past_seq = self.past_seq
        ex_cache = self.ex_cache

        seq = input_ids[0].tolist()
        seq_tensor = torch.tensor(seq)
        reset = True

        # Make the forward call
        if labels is None:
            if past_seq is not None:
                min_length = min(past_seq.shape[0], seq_tensor.shape[0])
                indices = torch.nonzero(~torch.eq(past_seq[:min_length], seq_tensor[:min_length]))
                if len(indices) > 0:
                    longest_prefix = indices[0].item()
                else:
                    longest_prefix = min_length

                if longest_prefix > 0:
                    reset = False
                    ex_cache.current_seq_len = longest_prefix
                    if len(seq_tensor) - longest_prefix > 1:
                        self.ex_model.forward(seq_tensor[longest_prefix:-1].view(1, -1), ex_cache, preprocess_only=True)
                    elif FIXED and len(seq_tensor) == longest_prefix:
                        # Very tricky: if the prefix we are reusing *is* the input_ids, then we have to back up the cache pointer by one,
                        # because we feed input_ids[-1] to forward() below, but that last token is already in the cache!
                        ex_cache.current_seq_len -= 1

            if reset:
                ex_cache.current_seq_len = 0
                if len(seq_tensor) > 1:
                    self.ex_model.forward(seq_tensor[:-1].view(1, -1), ex_cache, preprocess_only=True)

            logits = self.ex_model.forward(seq_tensor[-1:].view(1, -1), ex_cache).to(input_ids.device)
        else:
            ex_cache.current_seq_len = 0
            logits = self.ex_model.forward(seq_tensor.view(1, -1), ex_cache, last_id_only=False)

        self.past_seq = seq_tensor
        return CausalLMOutputWithPast(logits=logits, past_key_values=seq if use_cache else None, loss=None)


def encode(text):
    return [1] + [3 + (ord(c) - 32) % 61 for c in text]


def generate(model, input_ids, max_new_tokens):
    # greedy GenerationMixin loop; Exllamav2HF.prepare_inputs_for_generation returns all input_ids
    first_logits = None
    past_key_values = None
    for _ in range(max_new_tokens):
        out = model(input_ids=input_ids, use_cache=True, past_key_values=past_key_values)
        past_key_values = out.past_key_values
        next_logits = out.logits[:, -1, :]
        if first_logits is None:
            first_logits = next_logits[0].clone()
        next_token = next_logits.argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids, first_logits


def main():
    model = Exllamav2HF(ExLlamaV2Config())
    with torch.no_grad():
        for p in model.ex_model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    prompt = torch.tensor([encode("a")])
    for request in range(2):  # "Generate", then "Generate" again from the same prompt
        out, first_logits = generate(model, prompt, max_new_tokens=8)
        print(f"request {request}: tokens {out[0, prompt.shape[1]:].tolist()}, "
              f"first-step logits[:5] {[round(v, 4) for v in first_logits[:5].tolist()]}")


if __name__ == "__main__":
    main()
