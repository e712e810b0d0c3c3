# pytorch/torchchat#1462 (commit c536da40, "Increment start_pos by encoded size in generate").
# In chat mode LocalGenerator.chat keeps one KV cache across turns and passes start_pos to
# generate(), which prefills the new turn at input_pos = arange(start_pos, start_pos + len(prompt))
# and masks with causal_mask[None, None, input_pos] over the whole cache. start_pos was advanced
# only by the generated tokens, never by the prompt tokens, so the next turn was written into the
# middle of the cache (over the previous turn's prompt/answer) and its rows of the causal mask
# stopped short of the end of the history. Fix: in chat mode, start_pos += encoded.size(0).
# Trimmed port of torchchat/model.py (TransformerArgs, KVCache, Transformer, Attention, ...) and
# torchchat/generate.py (Llama3ChatFormatter, LocalGenerator.prefill / decode_n_tokens / generate /
# chat) for a tiny random Llama-3-style model on CPU; user input is scripted.
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def find_multiple(n: int, k: int) -> int:
    if n % k == 0:
        return n
    return n + k - (n % k)


@dataclass
class TransformerArgs:
    block_size: int = 256
    vocab_size: int = 112
    n_layers: int = 2
    n_heads: int = 4
    dim: int = 64
    hidden_dim: int = 128
    n_local_heads: int = 2
    head_dim: int = 16
    rope_base: float = 500000
    norm_eps: float = 1e-5
    max_seq_length: int = 256


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        assert input_pos.shape[0] == k_val.shape[2]
        k_out = torch.ops.aten.index_put_(self.k_cache, [None, None, input_pos], k_val)
        v_out = torch.ops.aten.index_put_(self.v_cache, [None, None, input_pos], v_val)
        return k_out, v_out


def precompute_freqs_cis(n_elem: int, seq_len: int, base: int = 10000, dtype=torch.float32) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        output = (x.float() * torch.rsqrt(torch.mean(x.float() * x.float(), dim=-1, keepdim=True) + self.eps)).type_as(x)
        return output * self.weight


class FeedForward(nn.Module):
    def __init__(self, config: TransformerArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, config: TransformerArgs):
        super().__init__()
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_local_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_local_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads

    def setup_cache(self, max_batch_size, max_seq_length, cache_lanes: int = 1):
        self.kv_cache = nn.ModuleList(
            [KVCache(max_batch_size, max_seq_length, self.n_local_heads, self.head_dim) for _ in range(cache_lanes)]
        )

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Optional[Tensor] = None, cache_lane: int = 0) -> Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if self.kv_cache is not None:
            k, v = self.kv_cache[cache_lane].update(input_pos, k, v)
        k = k.repeat_interleave(self.n_heads // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_heads // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(y)


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerArgs) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor, cache_lane: int = 0) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos, cache_lane=cache_lane)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: TransformerArgs) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size, max_seq_length, cache_lanes: int = 1):
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        max_seq_length = find_multiple(max_seq_length, 8)
        self.max_seq_length = max_seq_length
        self.max_batch_size = max_batch_size
        for b in self.layers.values():
            b.attention.setup_cache(max_batch_size, max_seq_length, cache_lanes=cache_lanes)
        freqs_cis = precompute_freqs_cis(self.config.dim // self.config.n_heads, self.config.block_size * 2, self.config.rope_base)
        self.register_buffer("freqs_cis", freqs_cis, persistent=True)
        causal_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))
        self.register_buffer("causal_mask", causal_mask, persistent=True)

    def forward(self, x: Tensor, input_pos: Optional[Tensor] = None, cache_lane: int = 0) -> Tensor:
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(x)
        for _, layer in self.layers.items():
            x = layer(x, input_pos, freqs_cis, mask, cache_lane=cache_lane)
        return self.output(self.norm(x))


class Tokenizer:
    """Character-level stand-in for the Llama 3 tiktoken tokenizer."""

    special_tokens = {"<|begin_of_text|>": 1, "<|end_of_text|>": 2, "<|start_header_id|>": 3, "<|end_header_id|>": 4, "<|eot_id|>": 5}

    def encode(self, s, bos=False, eos=False):
        return [8 + (ord(c) - 10) % 104 if ord(c) >= 10 else 6 for c in s]

    def eos_id(self):
        return self.special_tokens["<|end_of_text|>"]


class Llama3ChatFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _encode_header(self, role):
        tokens = [self.tokenizer.special_tokens["<|start_header_id|>"]]
        tokens.extend(self.tokenizer.encode(role, bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|end_header_id|>"])
        tokens.extend(self.tokenizer.encode("\n\n", bos=False, eos=False))
        return tokens

    def _encode_message(self, message):
        tokens = self._encode_header(message["role"])
        tokens.extend(self.tokenizer.encode(message["content"], bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|eot_id|>"])
        return tokens

    def encode_dialog_prompt(self, dialog, add_generation_prompt=True):
        tokens = [self.tokenizer.special_tokens["<|begin_of_text|>"]]
        for message in dialog:
            tokens.extend(self._encode_message(message))
        if add_generation_prompt and dialog and dialog[-1]["role"] != "assistant":
            tokens.extend(self._encode_header("assistant"))
        return tokens


class LocalGenerator:
    def __init__(self, model, tokenizer, user_inputs):
        self.model = model
        self.tokenizer = tokenizer
        self.chat_formatter = Llama3ChatFormatter(tokenizer)
        self.user_inputs = list(user_inputs)
        self.first_logits = []

    def get_user_input(self, prompt):
        return self.user_inputs.pop(0)

    def sample(self, logits, need_probs, temperature=0, top_k=None):
        logits = logits[0, -1]
        _, idx_next = torch.topk(logits, k=1, dim=-1)
        return (idx_next, None)

    def prefill(self, model, x, input_pos, *, sequential_prefill=True, **sampling_kwargs):
        width = x.size(1)
        assert input_pos.size(0) == width
        if sequential_prefill:
            for i in range(width):
                x_sliced, ip_sliced = x[:, i].view(-1, 1), input_pos[i].view(-1)
                logits = model(x_sliced, ip_sliced)
        else:
            logits = model(x, input_pos)
        self.first_logits.append(logits[0, -1].clone())
        return self.sample(logits, need_probs=False, **sampling_kwargs)[0]

    def decode_one_token(self, model, x, input_pos, need_probs, **sampling_kwargs):
        assert input_pos.shape[-1] == 1
        x = x.view(1, -1)
        logits = model(x, input_pos)
        return self.sample(logits, need_probs=need_probs, **sampling_kwargs)

    def decode_n_tokens(self, model, cur_token, input_pos, num_new_tokens, need_probs, eos_token_id=2, eot_id=None, **sampling_kwargs):
        for _i in range(num_new_tokens - 1):
            out_token = cur_token.clone()
            next_token, next_prob = self.decode_one_token(model, out_token, input_pos, need_probs=need_probs, **sampling_kwargs)
            input_pos += 1
            yield out_token, None
            cur_token = next_token
            if next_token.item() == eos_token_id or (eot_id is not None and next_token.item() == eot_id):
                self.decode_one_token(model, cur_token, input_pos, need_probs, **sampling_kwargs)
                input_pos += 1
                return
        eos_token = torch.tensor([eos_token_id if eot_id is None else eot_id], dtype=cur_token.dtype)
        self.decode_one_token(model, eos_token.view(1, -1), input_pos, need_probs, **sampling_kwargs)
        input_pos += 1
        yield eos_token.clone(), None

    @torch.no_grad()
    def generate(self, model, prompt, max_new_tokens, *, chat_mode, start_pos=0, skip_cache_setup=False, sequential_prefill=True, max_seq_length, **sampling_kwargs):
        prompt_length = prompt.size(0)
        max_new_tokens = min(max_new_tokens, max_seq_length - start_pos - prompt_length)
        if start_pos == 0 and not skip_cache_setup:
            model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
        input_pos = torch.arange(start_pos, prompt_length + start_pos, dtype=torch.int)
        next_token = self.prefill(model, prompt.view(1, -1), input_pos, sequential_prefill=sequential_prefill, **sampling_kwargs)
        yield None, {"time_to_first_token": 0.0}
        input_pos = torch.tensor([start_pos + prompt_length], dtype=torch.int)
        for generated_token, _ in self.decode_n_tokens(
            model, next_token, input_pos, max_new_tokens - 1, need_probs=False,
            eos_token_id=self.tokenizer.eos_id(), eot_id=self.tokenizer.special_tokens["<|eot_id|>"], **sampling_kwargs
        ):
            yield generated_token, None
        yield None, {"accept_counts": [0]}

    def chat(self, max_new_tokens=6, sequential_prefill=False):
        max_seq_length = self.model.config.max_seq_length
        self.system_prompt = self.get_user_input("What is your system prompt? \n")
        start_pos = 0
        replies = []
        for i in range(len(self.user_inputs)):
            is_first_sample = i == 0
            prompt = self.get_user_input("User: ")
            messages_to_encode = []
            if is_first_sample and self.system_prompt:
                messages_to_encode.append({"role": "system", "content": self.system_prompt})
            messages_to_encode.append({"role": "user", "content": prompt})
            encoded = self.chat_formatter.encode_dialog_prompt(messages_to_encode, add_generation_prompt=True)
            encoded = torch.tensor(encoded, dtype=torch.int)
            if encoded.size(0) + start_pos > max_seq_length:
                break
            generator_func = self.generate(
                self.model, encoded, max_new_tokens, chat_mode=True, start_pos=start_pos,
                skip_cache_setup=not is_first_sample, sequential_prefill=sequential_prefill, max_seq_length=max_seq_length,
            )
            if FIXED:
                start_pos += encoded.size(0)
            reply = []
            for token_tensor, metrics in generator_func:
                if token_tensor is not None:
                    start_pos += token_tensor.size(0)
                    reply.append(int(token_tensor.view(-1)[0]))
            replies.append(reply)
            print(f"turn {i}: prompt {encoded.size(0)} tokens, reply {reply}, start_pos now {start_pos}")
        return replies


def main():
    config = TransformerArgs()
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    gen = LocalGenerator(
        model,
        Tokenizer(),
        ["Be brief.", 'Remember this word: "berryjuice".', "What word did I ask you to remember?"],
    )
    gen.chat(max_new_tokens=8)
    print("turn 1 first-token logits[:6]:", [round(v, 4) for v in gen.first_logits[1][:6].tolist()])


if __name__ == "__main__":
    main()
